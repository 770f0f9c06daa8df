"""Reference solutions through the verifier (GPU): `python -m dice.bench verify --check FILE [--build WAY]`.

`check_reference_solutions(path, workers)`: runs the verifier over the reference solutions
(`cuda_code`) of a DICE JSON file and prints how many it calls correct and every rejection
(resumable through a verdict log). `compare_builds(path, workers, builds)` verifies them once per
build way, each with a fresh build cache, and prints each way's throughput and every solution
whose verdict differs between them.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time
from types import SimpleNamespace

from ..errors import DataError, read_text
from ..tasks.load import load_tasks
from ..verifier import Verifier
from ..verifier.inline_build.pool import BuildPool

from .common import BudgetSpent, build_way


def compare_builds(run, path: str, workers: int, builds: tuple[str, ...], timing: bool = False,
                   limit: int | None = None, prebuild: bool = False, **verifier_options) -> None:
    """Verify the reference solutions of a DICE JSON file once per build way, each in a fresh
    build cache; print each way's verdicts and throughput, then every solution they disagree on
    (only solutions every way reached, when the budget cut one short).
    prebuild: build every solution with a BuildPool (one process per core) before verifying."""
    tasks = [t for t in load_tasks(path) if t.solution][:limit]
    if not tasks:
        raise SystemExit(f"error: {path}: no records with a cuda_code reference solution; pass a DICE JSON file "
                         "with reference solutions")
    verdicts = {}
    try:
        for build in builds:
            run.check(f"the {build} build")
            with tempfile.TemporaryDirectory(prefix=f"dice-check-{build}-") as cache, build_way(build), \
                    Verifier(workers=workers, cache_dir=cache, **verifier_options) as verifier:
                start = time.perf_counter()
                if prebuild:
                    _prebuild_all(cache, [t.solution for t in tasks], build)
                broken = set()
                results, _, complete = run.verify_map(verifier, [(t.source, t.solution) for t in tasks],
                                                      f"{build} build", timing=timing,
                                                      on_broken_task=lambda i, e: broken.add(i))
                seconds = time.perf_counter() - start
            verdicts[build] = [r.status if r else "task_error" if i in broken else None for i, r in enumerate(results)]
            _verdict_row(run, f"{build} build", tasks, results, verdicts[build], seconds, complete)
    finally:
        _compare(tasks, verdicts)


def _verdict_row(run, label: str, tasks: list, results: list, statuses: list, seconds: float, complete: bool) -> None:
    """A row of verdict counts, and every solution that is not correct with its message."""
    counts = collections.Counter(s for s in statuses if s is not None)
    run.row({"way": label, "solutions": len(tasks), "verified": sum(counts.values()), "seconds": f"{seconds:.0f}",
             "kernels/min": f"{60 * sum(counts.values()) / max(seconds, 1e-9):.1f}",
             **{k: v for k, v in sorted(counts.items())}}, partial=not complete)
    for t, r, status in zip(tasks, results, statuses):
        if status is not None and status != "correct":
            lines = r.message.splitlines()[:4] if r is not None else []
            print(f"  - {t.name}: {status}: " + "\n      ".join(lines), flush=True)


def _compare(tasks: list, verdicts: dict) -> None:
    if len(verdicts) < 2:
        return
    ways = list(verdicts)
    reached = [i for i in range(len(tasks)) if all(verdicts[b][i] is not None for b in ways)]
    differ = [i for i in reached if len({verdicts[b][i] for b in ways}) > 1]
    print(f"verdicts equal on {len(reached) - len(differ)}/{len(reached)} solutions that every way verified "
          f"({' vs '.join(ways)}; {len(tasks)} in the file)")
    for i in differ:
        print(f"  - {tasks[i].name}: " + " vs ".join(verdicts[b][i] for b in ways))


def _prebuild_all(cache_dir: str, candidates: list[str], build: str) -> None:
    """Prebuild every candidate; print the build throughput, how each extension was built, and
    why the fast build fell back where it did."""
    start = time.perf_counter()
    with BuildPool(cache_dir, build=build) as pool:
        reports = [f.result() for f in [pool.submit(c) for c in candidates]]
    seconds = time.perf_counter() - start
    builds = [b for r in reports for b in r["builds"]]
    cpu = [b["host_cpu_s"] + b["device_cpu_s"] + b["link_cpu_s"] for b in builds if b["how"] == "fast"]
    print(f"prebuild ({build}): {len(candidates)} solutions in {seconds:.0f} s ({60 * len(candidates) / seconds:.1f}/min); "
          f"reports {dict(collections.Counter(r['status'] for r in reports))}; builds "
          f"{dict(collections.Counter(b['how'] for b in builds))}" +
          (f"; fast build CPU s per program: median {sorted(cpu)[len(cpu) // 2]:.2f}, mean {sum(cpu) / len(cpu):.2f}, "
           f"max {max(cpu):.2f}; precompiled header used {sum(b['pch'] for b in builds if b['how'] == 'fast')}"
           f"/{len(cpu)}" if cpu else ""), flush=True)
    for reason, count in collections.Counter(b["reason"] for b in builds if b["how"] == "torch").most_common():
        print(f"  torch's build {count}x: {reason[:200]}")


def read_log(log: str) -> dict[str, SimpleNamespace]:
    """The verdicts a --log holds, by solution name; a line that is not one is an error naming it."""
    earlier = {}
    for number, line in enumerate(read_text(log).splitlines(), 1):
        try:
            verdict = json.loads(line) if line.strip() else None
            if verdict is not None and not (isinstance(verdict, dict) and all(
                    isinstance(verdict.get(k), str) for k in ("name", "status", "message"))):
                raise ValueError("not an object with name, status and message strings")
        except ValueError as e:
            raise DataError(f"--log {log} line {number} is not a verdict ({e}); a run cut while writing leaves its "
                            "last line cut: delete that line, or the file to start over") from None
        if verdict is not None:
            earlier[verdict["name"]] = SimpleNamespace(**verdict)
    return earlier


def check_reference_solutions(run, path: str, workers: int, timing: bool = False, limit: int | None = None,
                              log: str | None = None, **verifier_options) -> None:
    """Verify every reference solution in a DICE JSON file; print the tally and each rejection.

    log: a JSONL file that receives one verdict per solution as it arrives ({"name", "status",
    "message"}); solutions already in it are not verified again, so a run cut short by a time
    limit continues where it stopped and the tally covers both runs. load_inline builds are cached
    (~/.cache/dice/torch_extensions), so a second run on the same machine is quick anyway."""
    tasks = [t for t in load_tasks(path) if t.solution][:limit]
    if not tasks:
        raise SystemExit(f"error: {path}: no records with a cuda_code reference solution; pass a DICE JSON file "
                         "with reference solutions")
    earlier = read_log(log) if log and os.path.exists(log) else {}
    todo = [t for t in tasks if t.name not in earlier]
    start, verdicts = time.perf_counter(), {}
    log_file = open(log, "a") if log else None

    def report(i, result):   # rejections are printed as they come, so a cut-short run still reports
        verdicts[i] = result
        if log_file:
            log_file.write(json.dumps({"name": todo[i].name, "status": result.status, "message": result.message}) + "\n")
            log_file.flush()
        if not result.correct:
            lines = result.message.splitlines()
            print(f"- {todo[i].name}: {result.status}: " + "\n    ".join(lines[:8]), flush=True)
        run.progress("reference solutions", len(verdicts) + len(earlier), len(tasks))
        if len(verdicts) < len(todo):
            run.check("the rest of the reference solutions")

    def broken_task(i, error):   # the task's own reference fails: reported, not fatal
        report(i, SimpleNamespace(status="task_error", correct=False, message=str(error)))

    run.check("the reference solutions")
    try:
        with Verifier(workers=workers, **verifier_options) as verifier:
            map_start = time.perf_counter()
            try:
                verifier.map([(t.source, t.solution) for t in todo], timing=timing, progress=report,
                             on_broken_task=broken_task)
            except BudgetSpent:
                pass
            # every solution here is a new task, so each judge computes a reference per solution
            judges, busy = verifier.judges, verifier.judge_busy_s / max(time.perf_counter() - map_start, 1e-9)
            costs = f"{verifier.worker_starts()}; {verifier.stats.stage_times() or 'no candidate verified'}"
    finally:
        if log_file:
            log_file.close()
    results = list(verdicts.values()) + [earlier[t.name] for t in tasks if t.name in earlier]
    statuses = collections.Counter(r.status for r in results)
    correct = statuses.get("correct", 0)
    reused = f", {len(tasks) - len(todo)} verdicts from {log}" if len(todo) < len(tasks) else ""
    run.row({"way": "reference solutions", "solutions": len(tasks), "verified": len(results),
             "seconds": f"{time.perf_counter() - start:.0f}", **dict(sorted(statuses.items()))},
            partial=len(results) < len(tasks))
    print(f"{correct}/{len(tasks)} reference solutions verified correct in {time.perf_counter() - start:.0f} s "
          f"({', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))}{reused}); "
          f"{judges} judge{'s' * (judges > 1)} busy {100 * busy / judges:.0f}% of the time")
    print(costs)
