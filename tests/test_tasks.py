"""Task loading from KernelBench folders and DICE JSON files (dice/tasks/load.py); bad files raise
DataError, which the commands print as one line."""

import ast
import json
from pathlib import Path

import pytest

from dice.errors import DataError
from dice.tasks.load import Task, check_task_source, load_tasks, missing_task_names, parse_python

FIXTURES = Path(__file__).parent / "fixtures" / "verifier"
TASK = (FIXTURES / "relu_task.py").read_text()


def make_kernelbench(root: Path) -> Path:
    for level, files in {"level1": ["10_Tenth.py", "2_Second.py"], "level2": ["1_First.py"]}.items():
        (root / level).mkdir(parents=True)
        for name in files:
            (root / level / name).write_text(TASK)
    (root / "level1" / "__init__.py").write_text("")
    (root / "notes").mkdir()
    return root


def test_kernelbench_root_is_loaded_in_level_and_problem_order(tmp_path):
    tasks = load_tasks(make_kernelbench(tmp_path))
    assert [(t.name, t.level) for t in tasks] == [
        ("level1/2_Second", 1), ("level1/10_Tenth", 1), ("level2/1_First", 2)]
    assert tasks[0].source == TASK and tasks[0].solution is None and tasks[0].middle is None


def test_single_level_folder_and_single_file(tmp_path):
    root = make_kernelbench(tmp_path)
    assert [t.name for t in load_tasks(root / "level2")] == ["level2/1_First"]
    assert load_tasks(root / "level1" / "2_Second.py") == [Task("level1/2_Second", 1, TASK)]
    plain = tmp_path / "mine"
    plain.mkdir()
    (plain / "3_Mine.py").write_text(TASK)
    assert load_tasks(plain) == [Task("3_Mine", None, TASK)]


def test_dice_json_records():
    infill = load_tasks(FIXTURES / "dice_infilling_sample.json")
    assert [t.name for t in infill] == ["dice_infilling_sample/6032", "dice_infilling_sample/8645"]
    first = infill[0]
    assert first.level is None and first.prefix + first.middle + first.suffix == first.solution
    e2e = load_tasks(FIXTURES / "dice_e2e_sample.json")
    assert [(t.name, t.level) for t in e2e] == [("dice_e2e_sample/0", 0), ("dice_e2e_sample/1", 1)]


def test_json_level_from_file_name_and_index_names(tmp_path):
    path = tmp_path / "kernelbench_level1.json"
    path.write_text(json.dumps([{"pytorch_code": TASK}, {"pytorch_code": TASK}]))
    assert [(t.name, t.level) for t in load_tasks(path)] == [("kernelbench_level1/0", 1), ("kernelbench_level1/1", 1)]


def test_missing_names_are_reported_with_the_file(tmp_path):
    assert missing_task_names("class Model: pass\n") == ["get_inputs", "get_init_inputs"]
    bad = tmp_path / "level1" / "1_Bad.py"
    bad.parent.mkdir()
    bad.write_text("import torch\nclass Model: pass\n")
    with pytest.raises(DataError, match=r"1_Bad.py: task source defines no get_inputs, get_init_inputs"):
        load_tasks(tmp_path)
    with pytest.raises(DataError, match="record 0: task source does not parse"):
        check_task_source("def (", "x.json record 0")


def test_bad_json_records(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([{"code": TASK}]))
    with pytest.raises(DataError, match="record 0: no 'pytorch_code'"):
        load_tasks(path)
    path.write_text(json.dumps([{"pytorch_code": TASK, "prefix": "a", "middle": "b"}]))
    with pytest.raises(DataError, match="only part of prefix/middle/suffix"):
        load_tasks(path)
    path.write_text(json.dumps({"pytorch_code": TASK}))
    with pytest.raises(DataError, match="holds an object, where a JSON list of task records"):
        load_tasks(path)


def test_level_underscore_folders_and_module_level_names_only(tmp_path):
    (tmp_path / "level_3").mkdir()
    (tmp_path / "level_3" / "4_Four.py").write_text(TASK)
    assert [(t.name, t.level) for t in load_tasks(tmp_path)] == [("level3/4_Four", 3)]
    method_only = "class Model:\n    def get_inputs(self): pass\n\ndef get_init_inputs(): pass\n"
    assert missing_task_names(method_only) == ["get_inputs"]           # a method is not the task's function


def test_json_record_ids_levels_and_split_types(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps([{"pytorch_code": TASK, "idx": 42, "level": 0}, {"pytorch_code": TASK, "id": "a"}]))
    assert [(t.name, t.level) for t in load_tasks(path)] == [("x/42", 0), ("x/a", None)]
    path.write_text(json.dumps([{"pytorch_code": TASK, "prefix": "a", "middle": 1, "suffix": "c"}]))
    with pytest.raises(DataError, match="only part of prefix/middle/suffix"):
        load_tasks(path)


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such task file"):
        load_tasks(tmp_path / "nope")
    with pytest.raises(DataError, match="found no tasks"):
        load_tasks(tmp_path)


def test_a_spurious_ast_recursion_mismatch_is_retried_and_a_persistent_one_raised(monkeypatch):
    """CPython 3.11 can fail a parse that overlaps another thread's (python/cpython#106905): such a
    SystemError is retried; any other error, or one that persists, reaches the caller."""
    real_parse, calls = ast.parse, []

    def flaky(fails, message):
        def parse(source, *args, **kwargs):
            calls.append(source)
            if len(calls) <= fails:
                raise SystemError(message)
            return real_parse(source, *args, **kwargs)
        return parse

    mismatch = "AST constructor recursion depth mismatch (before=24, after=22)"
    monkeypatch.setattr(ast, "parse", flaky(2, mismatch))
    assert [type(node).__name__ for node in parse_python("x = 1\ny = 2\n").body] == ["Assign", "Assign"]
    assert len(calls) == 3
    calls.clear()
    monkeypatch.setattr(ast, "parse", flaky(3, mismatch))
    with pytest.raises(SystemError, match="mismatch"):
        parse_python("x = 1\n")
    calls.clear()
    monkeypatch.setattr(ast, "parse", flaky(1, "some other interpreter error"))
    with pytest.raises(SystemError, match="other"):
        parse_python("x = 1\n")
    assert len(calls) == 1
