"""Kernel tasks: KernelBench folders and DICE JSON files -> `Task` records (DESIGN.md §8, §9).

A task is Python source in the KernelBench format: it defines `class Model(nn.Module)`,
`get_inputs()` (the forward arguments) and `get_init_inputs()` (the constructor arguments).
Two on-disk layouts are read:

- KernelBench: `root/level1/19_ReLU.py ...`, a single `levelN/` folder, or one `.py` file.
  Names are `level1/19_ReLU` (or the bare file stem when the level is unknown).
- DICE JSON: a list of records with `pytorch_code` and optionally `level`, `id` or `idx`,
  `cuda_code` (a reference solution) and `prefix` / `middle` / `suffix` (its infilling split).
  Names are `<file stem>/<id>`.

Filtering by level is the caller's business; every loaded source is checked (by its AST, without
running it) for the three names the verifier needs. BiC-RL reads a file as a stream of tasks
(`phase_tasks`, `curriculum`), each step the next run of it (`step_tasks`, DESIGN.md §7).
"""

from __future__ import annotations

import ast
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError, json_kind, json_problem, read_text

REQUIRED_NAMES = ("Model", "get_inputs", "get_init_inputs")
_PARSING = threading.Lock()


def parse_python(source: str, attempts: int = 3) -> ast.Module:
    """`ast.parse(source)`, one thread at a time: CPython 3.11's AST constructor keeps its recursion
    depth in interpreter-wide state, so two threads parsing at once can fail with a spurious
    "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905); the verifier
    and the reward's scoring threads parse candidates and tasks concurrently. A parse in a thread we
    do not own (Triton's JIT, say, while the trainer compiles) can still collide: that one is retried."""
    for _ in range(attempts - 1):
        try:
            with _PARSING:
                return ast.parse(source)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
    with _PARSING:
        return ast.parse(source)


@dataclass(frozen=True)
class Task:
    name: str
    level: int | None
    source: str
    prefix: str | None = None
    middle: str | None = None
    suffix: str | None = None
    solution: str | None = None


def missing_task_names(source: str) -> list[str]:
    """Names of REQUIRED_NAMES that `source` does not define at module level.

    Raises SyntaxError when the source does not parse."""
    defined = set()
    for node in parse_python(source).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
    return [name for name in REQUIRED_NAMES if name not in defined]


def check_task_source(source: str, where: str) -> None:
    """Raise DataError naming `where` unless `source` is a usable KernelBench task."""
    try:
        missing = missing_task_names(source)
    except SyntaxError as exc:
        raise DataError(f"{where}: task source does not parse (line {exc.lineno}: {exc.msg}); "
                        "fix the Python syntax of the task") from None
    if missing:
        raise DataError(f"{where}: task source defines no {', '.join(missing)}; a KernelBench task "
                        "needs class Model(nn.Module), get_inputs() and get_init_inputs()")


def load_tasks(path: str | Path) -> list[Task]:
    """Load every task under `path` (KernelBench root, level folder, .py file or DICE .json)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such task file or folder; pass a KernelBench folder, "
                                "a task .py file or a DICE .json file")
    if path.is_file() and path.suffix == ".json":
        return _load_json(path)
    if path.is_file() and path.suffix == ".py":
        return [_load_py(path, _level_of(path.parent.name))]
    if path.is_dir():
        level_dirs = sorted((d for d in path.iterdir() if d.is_dir() and _level_of(d.name) is not None),
                            key=lambda d: _level_of(d.name))
        folders = level_dirs or [path]
        tasks = [_load_py(f, _level_of(d.name)) for d in folders for f in _sorted_py_files(d)]
        if tasks:
            return tasks
    raise DataError(f"{path}: found no tasks; expected level*/NN_Name.py files, NN_Name.py files, "
                    "or a .json list of records with pytorch_code")


def _level_of(name: str) -> int | None:
    match = re.fullmatch(r"level_?(\d+)", name)
    return int(match.group(1)) if match else None


def _sorted_py_files(folder: Path) -> list[Path]:
    # KernelBench numbers its problems: 2_X.py sorts before 10_X.py.
    def key(f: Path):
        match = re.match(r"(\d+)", f.name)
        return (int(match.group(1)) if match else float("inf"), f.name)
    return sorted((f for f in folder.glob("*.py") if not f.name.startswith("_")), key=key)


def _load_py(path: Path, level: int | None) -> Task:
    source = read_text(path)
    check_task_source(source, str(path))
    name = f"level{level}/{path.stem}" if level is not None else path.stem
    return Task(name=name, level=level, source=source)


def _load_json(path: Path) -> list[Task]:
    try:
        records = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({json_problem(exc)}); fix it there (a task file holds a "
                        "JSON list of task records)") from None
    if not isinstance(records, list):
        raise DataError(f"{path} holds {json_kind(records)}, where a JSON list of task records (objects with a "
                        "pytorch_code field) was expected; put the records in a list")
    file_level = _level_of(re.sub(r".*(level_?\d+).*", r"\1", path.stem))
    tasks = []
    for i, record in enumerate(records):
        where = f"{path} record {i}"
        if not isinstance(record, dict) or not isinstance(record.get("pytorch_code"), str):
            raise DataError(f"{where}: no 'pytorch_code' string; DICE task files are lists of "
                            "objects with a pytorch_code field")
        check_task_source(record["pytorch_code"], where)
        split = [record.get(k) for k in ("prefix", "middle", "suffix")]
        if any(s is not None for s in split) and not all(isinstance(s, str) for s in split):
            raise DataError(f"{where}: has only part of prefix/middle/suffix; give all three strings or none")
        ident = record.get("id", record.get("idx", i))
        if not isinstance(ident, (str, int)) or isinstance(ident, bool):
            raise DataError(f"{where}: its id must be a string or a whole number, not {ident!r:.40}")
        if record.get("cuda_code") is not None and not isinstance(record["cuda_code"], str):
            raise DataError(f"{where}: its cuda_code must be a string (the solution's source), not "
                            f"{json_kind(record['cuda_code'], shown=True)}")
        tasks.append(Task(
            name=f"{path.stem}/{ident}",
            level=_record_level(record.get("level"), where, file_level),
            source=record["pytorch_code"],
            prefix=split[0], middle=split[1], suffix=split[2],
            solution=record.get("cuda_code"),
        ))
    return tasks


def _record_level(level, where: str, file_level: int | None) -> int | None:
    """A record's level: a whole number (or its digits as a string: DICE's files); the file's without one."""
    if level is None:
        return file_level
    if isinstance(level, str) and level.strip().isdigit():
        level = int(level)
    if type(level) is not int or level < 0:
        raise DataError(f"{where}: its level must be a whole number >= 0 (KernelBench's 1, 2, 3), not {level!r:.40}")
    return level


# ---------------------------------------------------------------- BiC-RL's task stream (DESIGN.md §7)

def phase_tasks(tasks: list[Task], data: str | None, infill: bool, order: str) -> list[Task]:
    """An RL phase's task stream: the infill phase keeps the tasks with a prefix/middle/suffix split
    (`data` names their file in the error), in `curriculum` order."""
    if infill:
        tasks = [t for t in tasks if t.prefix is not None]
        if not tasks:
            raise DataError(f"{data}: no task has the prefix/middle/suffix split the infill phase needs; pass "
                            "a DICE JSON file whose records have prefix, middle and suffix, or use --phase e2e")
    return curriculum(tasks, order)


def curriculum(tasks: list[Task], order: str = "curriculum") -> list[Task]:
    """The tasks in the order the RL steps take them (`step_tasks`; `--task-order`).

    curriculum (DICE): ascending level, stable, unknown levels last; a run shorter than one pass
    moves from level 1 to 3, so its reward curve mixes learning with difficulty. interleaved: the
    i-th of a level's n tasks (in file order) gets the key (i + 1/2) / n and the tasks go in
    ascending key (ties by level), so every run of consecutive tasks, and hence every step, holds
    each level in its share of the data (each prefix within one task of it; tests/test_rl_tasks.py)."""
    def level(t: Task):
        return (t.level is None, t.level or 0)
    if order == "curriculum":
        return sorted(tasks, key=level)
    rank, size = {}, {}
    for t in tasks:
        size[level(t)] = size.get(level(t), 0) + 1
    keyed = []
    for i, t in enumerate(tasks):
        r = rank[level(t)] = rank.get(level(t), -1) + 1
        keyed.append(((r + 0.5) / size[level(t)], level(t), i))
    return [tasks[i] for *_, i in sorted(keyed)]


def step_tasks(ordered: list[Task], step: int, count: int) -> list[Task]:
    """Step `step`'s `count` tasks: the next run of `ordered`, wrapping (DICE's `sequential_select`,
    `training/RL/sample/sdar_rl_rollout_kernel.py`, with `sequential_select: True` in its configs)."""
    return tasks_at(ordered, step * count, count)


def tasks_at(ordered: list[Task], first: int, count: int) -> list[Task]:
    """`count` tasks of `ordered` from position `first` on, wrapping."""
    return [ordered[(first + i) % len(ordered)] for i in range(count)]
