"""One GPU check per change: `python -m dice.bench check` (run from a checkout, on a GPU machine).

Runs, one after another and each within its own slice of `--budget-s` (default 540 s, so that
the whole check fits one 10-minute call on a lent machine):
1. the GPU test suite, `python -m pytest -q -m gpu` (`--fast`: `-m "gpu and not slow"`), every
   test's outcome and time logged as it ends (tests/conftest.py, DICE_TEST_LOG); printed as soon as
   it ends: the failures, the suite's wall time beside the tests' own time, each file's time and the
   ten slowest tests (`suite_summary`), so that a test that grew slow shows at once;
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

from .verify import INLINE_CANDIDATE, variants


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
    for r in reports:
        if r.get("failure"):
            print(f"FAILED {r['test']} ({r['when']}):\n" + "\n".join(r["failure"].splitlines()[-12:]), flush=True)
    row, lines = suite_summary(reports, seconds, None if status is not None else timeout_s)
    print("\n".join(lines), flush=True)
    return {"check": f"pytest -m '{marker}'", **row}


def suite_summary(reports: list[dict], wall_s: float, stopped_at: float | None = None,
                  top: int = 10) -> tuple[dict, list[str]]:
    """The test step's row ({result, seconds, detail}) and the lines printed under it, from the
    suite's DICE_TEST_LOG lines (tests/conftest.py: one per phase of a test): the wall time of the
    pytest run beside the tests' own time (the rest is start-up, collection and what runs between
    tests), each file's time, and the `top` slowest tests (setup + call + teardown). A test's worst
    phase decides its outcome (a failed teardown fails a passed call)."""
    tests: dict[str, dict] = {}
    for r in reports:
        test = tests.setdefault(r["test"], {"outcome": r["outcome"], "seconds": 0.0, "slow": r.get("slow", False)})
        test["seconds"] += r["seconds"]
        if r["outcome"] != "passed":
            test["outcome"] = r["outcome"]
    counts = {k: sum(t["outcome"] == k for t in tests.values()) for k in ("passed", "failed", "skipped", "xfailed")}
    own = sum(t["seconds"] for t in tests.values())
    quick = sum(t["seconds"] for t in tests.values() if not t["slow"])
    failed = [name for name, t in tests.items() if t["outcome"] == "failed"]
    result = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped" + (
        f", {counts['xfailed']} xfailed" if counts["xfailed"] else "") + (
        f" (stopped at {stopped_at:.0f} s)" if stopped_at is not None else "")
    detail = (f"wall {wall_s:.0f} s, tests' own time {own:.0f} s (not slow {quick:.0f} s), outside tests "
              f"{max(wall_s - own, 0.0):.0f} s" + (f"; failed: {', '.join(t.split('::')[-1] for t in failed[:6])}"
                                                   if failed else ""))
    if not tests:
        return {"result": result, "seconds": f"{wall_s:.0f}", "detail": detail}, [
            f"the test suite reported no test in its {wall_s:.0f} s (its output: tests.log in the logs folder)"]
    files: dict[str, float] = {}
    for name, t in tests.items():
        files[name.split("::")[0]] = files.get(name.split("::")[0], 0.0) + t["seconds"]
    slowest = sorted(tests.items(), key=lambda item: -item[1]["seconds"])[:top]
    lines = [f"test suite: wall {wall_s:.0f} s; tests' own time {own:.0f} s over {len(tests)} tests",
             "by file: " + ", ".join(f"{Path(f).name} {sec:.0f} s" for f, sec in
                                     sorted(files.items(), key=lambda item: -item[1])),
             f"slowest {len(slowest)} tests (setup + call + teardown):"]
    lines += [f"  {t['seconds']:7.1f} s  {'slow' if t['slow'] else '    '}  {t['outcome']:7}  {name}"
              for name, t in slowest]
    return {"result": result, "seconds": f"{wall_s:.0f}", "detail": detail}, lines


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def _solutions(n: int) -> Path:
    """A DICE JSON file (in a new temporary folder) of n salted load_inline elementwise programs
    (bench verify's)."""
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
        sys.exit(f"error: python -m dice.bench check runs the test suite of a checkout; {ROOT / 'tests'} does not "
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
