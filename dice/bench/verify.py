"""Verifier benchmark and reference-solution check (GPU): `python -m dice.bench verify [...]`.

`bench_verify(args)`: kernels verified per minute for the same elementwise tasks written as CuPy
(NVRTC) and as load_inline (nvcc) candidates: CuPy with a cold pool (worker start-up and NVRTC
compiles included) and a warm one, with and without timing; load_inline built each way
(`--build`, default both: torch's load_inline, and the split build of `verifier.fastbuild`) with
a warm pool and a cold then warm build cache (the fast build also with its precompiled header
already made, and prebuilt by a `prebuild.BuildPool` before verifying); the warm no-timing CuPy
row again with two judges; and load_inline evaluated KernelBench's way, one fresh Python process
per kernel, one at a time. Every kernel is a new source (salted), so no cache helps unless the row
says so. "judge busy" is the fraction of the row's time each judge spent answering: near 100%, the
judges bound the throughput.

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
import secrets
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

from dice.cli import ArgumentParser, at_least, fail_cleanly
from dice.data import DataError, read_text
from dice.tasks import load_tasks
from dice.verifier import Verifier
from dice.verifier.prebuild import BuildPool

BUILDS = {"torch": ("torch",), "fast": ("fast",), "both": ("torch", "fast")}

TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x * {scale} + {shift})


def get_inputs():
    return [torch.randn(2048, 2048)]


def get_init_inputs():
    return []
'''

CUPY_CANDIDATE = '''import cupy as cp
import torch
import torch.nn as nn

_source = r"""
extern "C" __global__ void scale_shift_relu_{tag}(const float* x, float* y, long long n) {{
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = fmaxf(x[i] * {scale}f + {shift}f, 0.0f);
}}
"""
_kernel = cp.RawModule(code=_source).get_function("scale_shift_relu_{tag}")


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            _kernel(((n + 255) // 256,), (256,), (x.data_ptr(), y.data_ptr(), cp.int64(n)))
        return y
'''

INLINE_CANDIDATE = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = """
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void scale_shift_relu_{tag}(const float* x, float* y, int64_t n) {{
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = fmaxf(x[i] * {scale}f + {shift}f, 0.0f);
}}

torch::Tensor run(torch::Tensor x) {{
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    int64_t n = xc.numel();
    scale_shift_relu_{tag}<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        xc.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}}
"""

ext = load_inline(name="scale_shift_relu_{tag}", cpp_sources="torch::Tensor run(torch::Tensor x);",
                  cuda_sources=cuda_source, functions=["run"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.run(x)
'''

# KernelBench's way: one fresh process per kernel builds, checks (5 trials) and times (100 calls).
ONE_PROCESS_EVAL = r'''
import json, sys, torch
task_src, candidate_src = json.load(sys.stdin)
task, cand = {}, {}
exec(task_src, task)
exec(candidate_src, cand)
torch.manual_seed(0)
ref = task["Model"](*task["get_init_inputs"]()).cuda()
torch.manual_seed(0)
new = cand["ModelNew"](*task["get_init_inputs"]()).cuda()
ok = True
with torch.no_grad():
    for seed in range(5):
        torch.manual_seed(seed)
        x = [t.cuda() for t in task["get_inputs"]()]
        ok &= torch.allclose(ref(*x), new(*x), atol=1e-2, rtol=1e-2)
    for _ in range(3):
        new(*x)
    times = []
    for _ in range(100):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); new(*x); end.record(); torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
print(json.dumps({"correct": bool(ok), "ms": sorted(times)[50]}))
'''


def variants(n: int, salt: str) -> list[tuple[str, dict]]:
    """n (task source, template fields) pairs; the salt makes every kernel source new."""
    out = []
    for i in range(n):
        fields = {"tag": f"{salt}_{i}", "scale": f"{1.0 + 0.25 * i:.2f}", "shift": f"{0.01 * i:.2f}"}
        out.append((TASK.format(**fields), fields))
    return out


def _row(label: str, n: int, seconds: float, statuses: collections.Counter, judge_busy: float | None = None) -> dict:
    row = {"mode": label, "kernels": n, "seconds": f"{seconds:.1f}", "kernels/min": f"{60 * n / seconds:.1f}",
           "judge busy": "-" if judge_busy is None else f"{100 * judge_busy:.0f}%",
           "verdicts": " ".join(f"{k}={v}" for k, v in sorted(statuses.items()))}
    print(" | ".join(str(v) for v in row.values()), file=sys.stderr, flush=True)   # a cut-short run still reports
    return row


def _timed_map(verifier: Verifier, pairs: list, **options) -> tuple[float, collections.Counter, float]:
    """(seconds, verdict counts, fraction of the time each judge was busy answering)."""
    start, busy = time.perf_counter(), verifier.judge_busy_s
    results = verifier.map(pairs, **options)
    seconds = time.perf_counter() - start
    return seconds, collections.Counter(r.status for r in results), \
        (verifier.judge_busy_s - busy) / seconds / verifier.judges


def _print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    for values in [keys] + [[r[k] for k in keys] for r in rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(values, widths)))


def bench_verify(args) -> None:
    """Print kernels verified per minute for each way of verifying (see module docstring)."""
    workers, n_cupy, n_inline = args.workers, args.kernels, args.inline_kernels
    salt = secrets.token_hex(3)
    scratch = tempfile.mkdtemp(prefix="dice-bench-verify-")
    os.environ["CUPY_CACHE_DIR"] = os.path.join(scratch, "cupy")  # workers inherit it: cold NVRTC
    cupy_a = [(task, CUPY_CANDIDATE.format(**f)) for task, f in variants(n_cupy, salt + "a")]
    cupy_b = [(task, CUPY_CANDIDATE.format(**f)) for task, f in variants(n_cupy, salt + "b")]
    cupy_c = [(task, CUPY_CANDIDATE.format(**f)) for task, f in variants(n_cupy, salt + "c")]
    cupy_d = [(task, CUPY_CANDIDATE.format(**f)) for task, f in variants(n_cupy, salt + "d")]
    rows = []
    start = time.perf_counter()
    with Verifier(workers=workers, judges=1, cache_dir=os.path.join(scratch, "cache")) as verifier:
        seconds, statuses, busy = _timed_map(verifier, cupy_a)
        total = time.perf_counter() - start    # the row includes the pool's start-up
        rows.append(_row(f"cupy, cold pool ({workers} workers, 1 judge), timing", n_cupy, total, statuses,
                         busy * seconds / total))
        rows.append(_row("cupy, warm pool, timing", n_cupy, *_timed_map(verifier, cupy_b)))
        rows.append(_row("cupy, warm pool, no timing (RL reward)", n_cupy, *_timed_map(verifier, cupy_c, timing=False)))
    for build in BUILDS[args.build] if n_inline else ():
        rows += _inline_rows(build, workers, n_inline, salt, os.path.join(scratch, f"cache-{build}"))
    with Verifier(workers=workers, judges=2, cache_dir=os.path.join(scratch, "cache")) as verifier:
        _timed_map(verifier, cupy_a, timing=False)   # warm: start-up, and NVRTC from CuPy's disk cache
        rows.append(_row("cupy, warm pool, no timing, 2 judges", n_cupy, *_timed_map(verifier, cupy_d, timing=False)))
    if n_inline and not args.skip_one_process:
        one_process = [(task, INLINE_CANDIDATE.format(**f)) for task, f in variants(n_inline, salt + "k")]
        start, statuses = time.perf_counter(), collections.Counter()
        for task, candidate in one_process:
            done = subprocess.run([sys.executable, "-c", ONE_PROCESS_EVAL], input=json.dumps([task, candidate]),
                                  capture_output=True, text=True, timeout=1800)
            ok = done.returncode == 0 and json.loads(done.stdout.strip().splitlines()[-1])["correct"]
            statuses["correct" if ok else "failed"] += 1
        rows.append(_row("load_inline, one process per kernel (KernelBench), timing", n_inline,
                         time.perf_counter() - start, statuses))
    _print_table(rows)


@contextmanager
def build_way(build: str | None):
    """Workers started inside build their load_inline extensions this way (`build.BuildCache`
    reads DICE_INLINE_BUILD; the workers inherit the environment)."""
    before = os.environ.get("DICE_INLINE_BUILD")
    if build:
        os.environ["DICE_INLINE_BUILD"] = build
    try:
        yield
    finally:
        os.environ.pop("DICE_INLINE_BUILD", None)
        if before is not None:
            os.environ["DICE_INLINE_BUILD"] = before


def _inline_rows(build: str, workers: int, n: int, salt: str, cache_dir: str) -> list[dict]:
    """The load_inline rows for one build way, in a fresh build cache."""
    inline = [(task, INLINE_CANDIDATE.format(**f)) for task, f in variants(n, salt + "i" + build)]
    rows = []
    with build_way(build), Verifier(workers=workers, judges=1, cache_dir=cache_dir) as verifier:
        first = "cold build cache" + (" and precompiled header" if build == "fast" else "")
        rows.append(_row(f"load_inline ({build} build), warm pool, {first}, timing", n, *_timed_map(verifier, inline)))
        rows.append(_row(f"load_inline ({build} build), warm pool, warm build cache, timing", n,
                         *_timed_map(verifier, inline)))
        if build == "fast":
            again = [(task, INLINE_CANDIDATE.format(**f)) for task, f in variants(n, salt + "j")]
            rows.append(_row("load_inline (fast build), warm pool, cold build cache, timing", n,
                             *_timed_map(verifier, again)))
            prebuilt = [(task, INLINE_CANDIDATE.format(**f)) for task, f in variants(n, salt + "p")]
            start = time.perf_counter()
            with BuildPool(cache_dir, timeout_s=900) as pool:
                reports = [f.result() for f in [pool.submit(candidate) for _, candidate in prebuilt]]
            built = time.perf_counter() - start
            seconds, statuses, busy = _timed_map(verifier, prebuilt)
            statuses.update(f"prebuild {r['status']}" for r in reports)
            rows.append(_row(f"load_inline (fast build), BuildPool prebuild ({built:.0f} s) then verify, timing", n,
                             built + seconds, statuses, busy * seconds / (built + seconds)))
    return rows


def compare_builds(path: str, workers: int, builds: tuple[str, ...], timing: bool = False, limit: int | None = None,
                   prebuild: bool = False, **verifier_options) -> None:
    """Verify the reference solutions of a DICE JSON file once per build way, each in a fresh
    build cache; print each way's verdicts and throughput, then every solution they disagree on.
    prebuild: build every solution with a BuildPool (one process per core) before verifying."""
    tasks = [t for t in load_tasks(path) if t.solution][:limit]
    if not tasks:
        raise SystemExit(f"{path}: no records with a cuda_code reference solution")
    verdicts = {}
    for build in builds:
        with tempfile.TemporaryDirectory(prefix=f"dice-check-{build}-") as cache, build_way(build), \
                Verifier(workers=workers, cache_dir=cache, **verifier_options) as verifier:
            start = time.perf_counter()
            if prebuild:
                _prebuild_all(cache, [t.solution for t in tasks], build)
            results = verifier.map([(t.source, t.solution) for t in tasks], timing=timing,
                                   on_broken_task=lambda i, e: None)
            seconds = time.perf_counter() - start
        verdicts[build] = [r.status if r else "task_error" for r in results]
        statuses = collections.Counter(verdicts[build])
        print(f"{build} build: {len(tasks)} solutions in {seconds:.0f} s ({60 * len(tasks) / seconds:.1f} kernels/min; "
              f"{', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))})", flush=True)
        for t, r in zip(tasks, results):
            if r is not None and not r.correct:
                print(f"  - {t.name}: {r.status}: " + "\n      ".join(r.message.splitlines()[:4]), flush=True)
    if len(builds) > 1:
        differ = [(t.name, *(verdicts[b][i] for b in builds)) for i, t in enumerate(tasks)
                  if len({verdicts[b][i] for b in builds}) > 1]
        print(f"verdicts equal on {len(tasks) - len(differ)}/{len(tasks)} solutions ({' vs '.join(builds)})")
        for name, *statuses in differ:
            print(f"  - {name}: " + " vs ".join(statuses))


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


def check_reference_solutions(path: str, workers: int, timing: bool = False, limit: int | None = None,
                              log: str | None = None, **verifier_options) -> None:
    """Verify every reference solution in a DICE JSON file; print the tally and each rejection.

    log: a JSONL file that receives one verdict per solution as it arrives ({"name", "status",
    "message"}); solutions already in it are not verified again, so a run cut short by a time
    limit continues where it stopped and the tally covers both runs. load_inline builds are cached
    (~/.cache/dice/torch_extensions), so a second run on the same machine is quick anyway."""
    tasks = [t for t in load_tasks(path) if t.solution][:limit]
    if not tasks:
        raise SystemExit(f"{path}: no records with a cuda_code reference solution")
    earlier = read_log(log) if log and os.path.exists(log) else {}
    todo = [t for t in tasks if t.name not in earlier]
    start, done = time.perf_counter(), [len(tasks) - len(todo)]
    live = sys.stderr.isatty()   # a counter on a terminal; in a log it would glue onto the rejections
    every = max(1, len(tasks) // 20)
    log_file = open(log, "a") if log else None

    def report(i, result):   # rejections are printed as they come, so a cut-short run still reports
        done[0] += 1
        if log_file:
            log_file.write(json.dumps({"name": todo[i].name, "status": result.status, "message": result.message}) + "\n")
            log_file.flush()
        if not result.correct:
            lines = result.message.splitlines()
            print(("\r\033[K" if live else "") + f"- {todo[i].name}: {result.status}: " + "\n    ".join(lines[:8]),
                  flush=True)
        if live:
            print(f"\r{done[0]}/{len(tasks)} verified", end="", file=sys.stderr, flush=True)
        elif done[0] % every == 0:
            print(f"{done[0]}/{len(tasks)} verified", flush=True)

    broken = {}

    def broken_task(i, error):   # the task's own reference fails: reported, not fatal
        broken[i] = SimpleNamespace(status="task_error", correct=False, message=str(error))
        report(i, broken[i])

    try:
        with Verifier(workers=workers, **verifier_options) as verifier:
            map_start = time.perf_counter()
            results = verifier.map([(t.source, t.solution) for t in todo], timing=timing, progress=report,
                                   on_broken_task=broken_task)
            # every solution here is a new task, so each judge computes a reference per solution
            judges, busy = verifier.judges, verifier.judge_busy_s / max(time.perf_counter() - map_start, 1e-9)
    finally:
        if log_file:
            log_file.close()
    results = [broken.get(i, r) for i, r in enumerate(results)] + [earlier[t.name] for t in tasks
                                                                   if t.name in earlier]
    if live:
        print(file=sys.stderr)
    statuses = collections.Counter(r.status for r in results)
    correct = statuses.get("correct", 0)
    reused = f", {len(tasks) - len(todo)} verdicts from {log}" if len(todo) < len(tasks) else ""
    print(f"{correct}/{len(tasks)} reference solutions verified correct in {time.perf_counter() - start:.0f} s "
          f"({', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))}{reused}); "
          f"{judges} judge{'s' * (judges > 1)} busy {100 * busy / judges:.0f}% of the time")


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m dice.bench verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=at_least(1), default=8, help="verifier worker processes")
    parser.add_argument("--kernels", type=at_least(1), default=32, help="CuPy kernels per CuPy row")
    parser.add_argument("--inline-kernels", type=at_least(1), default=4, help="load_inline kernels per load_inline row")
    parser.add_argument("--skip-one-process", action="store_true", help="skip the KernelBench-way row")
    parser.add_argument("--check", metavar="JSON", help="instead verify the reference solutions in a DICE JSON file")
    parser.add_argument("--timing", action="store_true", help="with --check: also time each solution")
    parser.add_argument("--limit", type=at_least(1), help="with --check: only the first N solutions")
    parser.add_argument("--judges", type=at_least(1), help="with --check: reference processes (default: one per 8 workers)")
    parser.add_argument("--log", metavar="JSONL", help="with --check: append each verdict here; solutions "
                        "already logged are skipped (continue a run that was cut short; delete the file to start over)")
    parser.add_argument("--prebuild", action="store_true", help="with --check --build: build every solution "
                        "with a BuildPool (a process per core) before verifying it; prints build throughput and fallbacks")
    parser.add_argument("--build", choices=BUILDS, help="how load_inline extensions are built: torch's load_inline, "
                        "the fast split build, or both side by side (default: both for the bench; for --check the "
                        "verifier's default, fast, and both compares the verdicts)")
    args = parser.parse_args(argv)
    if args.log and args.check and Path(args.log).resolve() == Path(args.check).resolve():
        parser.error("argument --log: it is the --check file, which verdicts would be appended to; give another file")
    if not torch.cuda.is_available():
        sys.exit("python -m dice.bench verify needs a CUDA GPU; this machine has none")
    if args.check and args.build:
        if args.log:
            parser.error("--log resumes one run; with --build each way is verified afresh, so leave --log out")
        compare_builds(args.check, args.workers, BUILDS[args.build], timing=args.timing, limit=args.limit,
                       prebuild=args.prebuild, judges=args.judges)
    elif args.check:
        check_reference_solutions(args.check, args.workers, timing=args.timing, limit=args.limit, log=args.log,
                                  judges=args.judges)
    else:
        args.build = args.build or "both"
        bench_verify(args)


if __name__ == "__main__":
    fail_cleanly(main)
