"""One GPU check per change: `python -m dice.bench check` (run from a checkout, on a GPU machine).

Runs, one after another and each within its own slice of `--budget-s` (default 540 s, so that
the whole check fits one 10-minute call on a lent machine):
1. the GPU test suite, `python -m pytest -q -m gpu` (`--fast`: `-m "gpu and not slow"`), every
   test's outcome and time logged as it ends (tests/conftest.py, DICE_TEST_LOG);
2. `bench verify`: CuPy kernels verified per minute (cold pool with timing, warm untimed: the RL
   reward) and load_inline with the fast build (cold build cache, timed);
3. `bench builds`: load_inline fast builds per minute (generic binding, one program per core);
4. `bench rl`: a small BiC-RL step of a random 1.7B shape (rollout tokens/s, generate / verify
   exposed / update seconds, the update's TFLOP/s).
Steps 2-4 replay the salted elementwise programs of `bench verify`, so the check needs no data
file. Each step's own output goes to `--logs` (default a temporary folder; named at the end),
and one table is printed last. A step that overruns its slice is stopped (its process group
killed) and its row says so; nothing of it is left running.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]      # the checkout: tests/ beside dice/
SLICES = {"verify": 0.3, "builds": 0.3, "rl": 0.4}   # of what the tests leave


def _run(argv: list[str], log: Path, timeout_s: float, env: dict | None = None) -> tuple[int | None, float]:
    """(exit status or None when stopped at the timeout, seconds), output into `log`; the command
    runs in its own process group, which is killed whole at the timeout."""
    start = time.perf_counter()
    with open(log, "w") as out:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)   # a checkout, uninstalled
        process = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})})
        try:
            status = process.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            status = None
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)   # what the step left behind, or the step itself
            except ProcessLookupError:
                pass
            process.wait()
    return status, time.perf_counter() - start


def _tests(args, logs: Path, timeout_s: float) -> dict:
    marker = "gpu and not slow" if args.fast else "gpu"
    record = logs / "tests.jsonl"
    status, seconds = _run([sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider",
                            *args.pytest_args], logs / "tests.log", timeout_s, {"DICE_TEST_LOG": str(record)})
    reports = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    outcome = {}
    for r in reports:   # a test's worst phase decides (a failed teardown fails a passed call)
        if r["outcome"] != "passed" or r["test"] not in outcome:
            outcome[r["test"]] = r["outcome"]
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "skipped")}
    fast = sum(r["seconds"] for r in reports if not r["slow"])
    failed = [t for t, v in outcome.items() if v == "failed"]
    for r in reports:
        if r.get("failure"):
            print(f"FAILED {r['test']} ({r['when']}):\n" + "\n".join(r["failure"].splitlines()[-12:]), flush=True)
    return {"check": f"pytest -m '{marker}'", "result": f"{counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped" + ("" if status is not None else f" (stopped at {timeout_s:.0f} s)"),
            "seconds": f"{seconds:.0f}", "detail": f"not-slow tests' own time {fast:.0f} s"
            + (f"; failed: {', '.join(t.split('::')[-1] for t in failed[:6])}" if failed else "")}


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def _solutions(n: int) -> Path:
    """A DICE JSON file (in a new temporary folder) of n salted load_inline elementwise programs
    (bench verify's)."""
    from .verify import INLINE_CANDIDATE, variants
    records = [{"id": i, "level": 1, "pytorch_code": task, "cuda_code": INLINE_CANDIDATE.format(**fields)}
               for i, (task, fields) in enumerate(variants(n, f"check{os.getpid()}"))]
    path = Path(tempfile.mkdtemp(prefix="dice-check-solutions-")) / "solutions.json"
    path.write_text(json.dumps(records))
    return path


def _bench(name: str, argv: list[str], logs: Path, slice_s: float) -> tuple[list[dict], str]:
    """Run `python -m dice.bench name ...` with --budget-s inside its slice; (its rows, a note)."""
    out = logs / f"{name}.jsonl"
    budget = max(10.0, 0.6 * slice_s)     # the rest of the slice lets the work in flight finish
    status, seconds = _run([sys.executable, "-m", "dice.bench", name, *argv, "--budget-s", f"{budget:.0f}",
                            "--out", str(out)], logs / f"{name}.log", slice_s)
    note = f"{seconds:.0f} s" + ("" if status == 0 else " (stopped at its slice)" if status is None
                                 else f" (exit status {status}: see {logs / (name + '.log')})")
    return _rows(out), note


def _pick(rows: list[dict], key: str, text: str) -> dict | None:
    return next((r for r in rows if text in str(r.get(key, ""))), None)


def bench_check(args, bench) -> None:
    """The steps of the module docstring; the table of their rows is printed last (BenchRun.finish)."""
    if not (ROOT / "tests").is_dir():
        sys.exit(f"python -m dice.bench check runs the test suite of a checkout; {ROOT / 'tests'} does not "
                 "exist (installed from a wheel?): run it from a git clone of the project")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="dice-check-"))
    logs.mkdir(parents=True, exist_ok=True)
    total = bench.budget_s or 540.0
    print(f"logs: {logs}", flush=True)
    bench.progress("the GPU test suite")
    bench.row(_tests(args, logs, args.tests_s or 0.6 * total))
    left = total - bench.elapsed()
    workers = str(min(16, os.cpu_count() or 1))
    solutions = _solutions(4 * int(workers))
    steps = [("verify", ["--kernels", "64", "--inline-kernels", "8", "--workers", workers, "--build", "fast",
                         "--skip-one-process", "--skip-timed"]),
             ("builds", ["--solutions", str(solutions), "--binding", "dispatch", "--jobs", workers]),
             ("rl", ["--shape", "1.7b", "--solutions", str(solutions), "--tasks-per-step", "4", "--group-size", "4",
                     "--max-new-tokens", "1024", "--workers", workers, "--broken", "0.25"])]
    for name, argv in steps:
        slice_s = SLICES[name] * left
        if bench.left() < 10:
            bench.row({"check": f"bench {name}", "result": "not run: the budget is spent", "seconds": "0", "detail": ""})
            continue
        bench.progress(f"bench {name}")
        found, note = _bench(name, argv, logs, min(slice_s, bench.left()))
        bench.row({"check": f"bench {name}", **_summary(name, found, note), "seconds": note.split()[0]})


def _summary(name: str, rows: list[dict], note: str) -> dict:
    """The headline numbers of one benchmark's rows."""
    if not rows:
        return {"result": "no result", "detail": note}
    if name == "verify":
        untimed = _pick(rows, "mode", "no timing (RL reward)")
        cold = _pick(rows, "mode", "cold pool")
        inline = _pick(rows, "mode", "load_inline (fast build), warm pool, cold build cache and precompiled header")
        parts = [f"CuPy untimed {untimed['kernels/min']}/min" if untimed else "",
                 f"CuPy cold pool {cold['kernels/min']}/min" if cold else "",
                 f"load_inline cold {inline['kernels/min']}/min" if inline else ""]
        return {"result": "; ".join(p for p in parts if p), "detail": note}
    if name == "builds":
        r = rows[0]
        return {"result": f"{r['programs/min']} programs/min, {r['per program']} CPU s each ({r['built']} built)",
                "detail": note}
    r = rows[-1]
    return {"result": f"{r.get('tokens/s')} tokens/s; generate {r.get('generate s')} s, verify exposed "
            f"{r.get('verify exposed s')} s, update {r.get('update s')} s ({r.get('update TFLOP/s')} TFLOP/s)",
            "detail": f"{note}; compile {r.get('compile s')} s; peak {r.get('peak GiB')} GiB"}


def add_arguments(p) -> None:
    p.add_argument("--fast", action="store_true", help="the GPU tests without the slow ones (-m 'gpu and not slow')")
    p.add_argument("--tests-s", type=float, help="seconds for the test suite (default: 60%% of the budget)")
    p.add_argument("--logs", metavar="DIR", help="where each step's output goes (default: a new temporary folder)")
    p.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -- tests/test_gpu.py")
