"""Verifier throughput (GPU): `python -m dice.bench verify [...]`; `--check FILE` runs `references`.

`bench_verify(args)`: kernels verified per minute for the same elementwise tasks written as CuPy
(NVRTC) and as load_inline (nvcc) candidates: CuPy with a cold pool (worker start-up and NVRTC
compiles included) and a warm one, with and without timing, and untimed in groups as an RL step
sends them (`--group-size` samples of each task, every one a new source: the task's references are
computed once for its group); load_inline built each way
(`--build`, default both: torch's load_inline, and the split build of `verifier.inline_build.fast`) with
a warm pool and a cold then warm build cache (the fast build also with its precompiled header
already made, and prebuilt by a `pool.BuildPool` before verifying); the warm no-timing CuPy
row again with one judge (the default is one per 4 workers); and load_inline evaluated KernelBench's way, one fresh Python process
per kernel, one at a time. Every kernel is a new source (salted), so no cache helps unless the row
says so. "judge busy" is the fraction of the row's time each judge spent answering: near 100%, the
judges bound the throughput; "judge s by op" splits that time by request (reference: a new
task's reference outputs; compare: a candidate's outputs against them).

`--check FILE`: the reference solutions of a DICE JSON file through the verifier (`references`).
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
from pathlib import Path
from types import SimpleNamespace

import torch

from ..cli import ArgumentParser, at_least, fail_cleanly
from ..verifier import Verifier
from ..verifier.inline_build.pool import BuildPool

from .common import BenchRun, BudgetSpent, add_run_arguments, build_way
from .references import check_reference_solutions, compare_builds

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


def grouped(n: int, group: int, salt: str) -> list[tuple[str, dict]]:
    """n (task source, template fields) pairs as an RL step's groups: each task `group` times, each
    time a kernel of a new source computing that task."""
    tasks = variants(-(-n // group), salt)
    return [(task, {**fields, "tag": f"{fields['tag']}_{j}"}) for task, fields in tasks for j in range(group)][:n]


def _row(run, label: str, n: int, results: list, seconds: float, complete: bool, judge_busy: float | None = None,
         judge_ops: dict | None = None, starts: str = "", worker_ops: dict | None = None, stages: str = "") -> dict:
    """One throughput row: kernels finished per minute of the row's time; the judges' busy share
    and their seconds per request op (which of their jobs bounds them), the candidate workers'
    seconds per op (start-ups not included); the workers started in it (a load_inline candidate's
    is replaced after it: forked, ~1 s, or a new interpreter, ~9 s); a candidate's median seconds
    in its stages (`Verifier.stats`: the prebuild, the task's plan, waiting for a worker, on it)."""
    done = [r for r in results if r is not None]
    statuses = collections.Counter(r.status for r in done)
    return run.row({"mode": label, "kernels": f"{len(done)}" if complete else f"{len(done)}/{n}",
                    "seconds": f"{seconds:.1f}", "kernels/min": f"{60 * len(done) / max(seconds, 1e-9):.1f}",
                    "judge busy": "-" if judge_busy is None else f"{100 * judge_busy:.0f}%",
                    "judge s by op": _by_op(judge_ops), "worker s by op": _by_op(worker_ops),
                    "verdicts": " ".join(f"{k}={v}" for k, v in sorted(statuses.items())),
                    "worker starts": starts.removeprefix("worker starts: ") or "-",
                    "stages": stages.removeprefix("median ") or "-"}, partial=not complete)


def _by_op(seconds: dict | None) -> str:
    return " ".join(f"{op}={s:.1f}" for op, s in sorted((seconds or {}).items(), key=lambda x: -x[1])
                    if s >= 0.05) or "-"


def _map_row(run, verifier: Verifier, label: str, pairs: list, started: float | None = None, **options) -> dict:
    """Verify `pairs` and add their row; `started`: the row's clock started earlier (a cold pool)."""
    busy, ops, (starts, stages) = verifier.judge_busy_s, verifier.busy_by_op(), verifier.stats.marks()
    results, seconds, complete = run.verify_map(verifier, pairs, label, **options)
    total = seconds if started is None else time.perf_counter() - started
    after = verifier.busy_by_op()
    spent = {role: {op: s - ops[role].get(op, 0.0) for op, s in after[role].items()} for role in after}
    return _row(run, label, len(pairs), results, total, complete,
                (verifier.judge_busy_s - busy) / total / verifier.judges, spent["judge"],
                verifier.worker_starts(since=starts), spent["candidate"], verifier.stats.stage_times(stages))


def bench_verify(args, run) -> None:
    """Kernels verified per minute for each way of verifying (module docstring), rows in the order
    of what matters most, so that a budget cuts the least telling ones."""
    workers, n_cupy, n_inline = args.workers, args.kernels, args.inline_kernels
    salt = secrets.token_hex(3)
    scratch = tempfile.mkdtemp(prefix="dice-bench-verify-")
    os.environ["CUPY_CACHE_DIR"] = os.path.join(scratch, "cupy")  # workers inherit it: cold NVRTC
    cupy = {k: [(task, CUPY_CANDIDATE.format(**f)) for task, f in variants(n_cupy, salt + k)] for k in "abcd"}
    cupy["g"] = [(task, CUPY_CANDIDATE.format(**f)) for task, f in grouped(n_cupy, args.group_size, salt + "g")]
    start = time.perf_counter()
    timing = not args.skip_timed
    with Verifier(workers=workers, cache_dir=os.path.join(scratch, "cache")) as verifier:
        judges = f"{verifier.judges} judge{'s' * (verifier.judges > 1)}"
        _map_row(run, verifier, f"cupy, cold pool ({workers} workers, {judges}), {'timing' if timing else 'no timing'}",
                 cupy["a"], started=start, timing=timing)
        _map_row(run, verifier, "cupy, warm pool, no timing (RL reward)", cupy["c"], timing=False)
        _map_row(run, verifier, f"cupy, warm pool, no timing, groups of {args.group_size} (an RL step's)", cupy["g"],
                 timing=False)
        if timing:
            _map_row(run, verifier, "cupy, warm pool, timing", cupy["b"])
    for build in BUILDS[args.build] if n_inline else ():
        _inline_rows(run, build, workers, n_inline, salt, os.path.join(scratch, f"cache-{build}"), timing)
    run.check("cupy, 1 judge")
    with Verifier(workers=workers, judges=1, cache_dir=os.path.join(scratch, "cache")) as verifier:
        run.verify_map(verifier, cupy["a"], "warming the 1-judge pool", timing=False)
        _map_row(run, verifier, "cupy, warm pool, no timing, 1 judge", cupy["d"], timing=False)
    if n_inline and not args.skip_one_process:
        label = "load_inline, one process per kernel (KernelBench), timing"
        one_process = [(task, INLINE_CANDIDATE.format(**f)) for task, f in variants(n_inline, salt + "k")]
        start, results = time.perf_counter(), []
        for task, candidate in one_process:
            run.check(f"the rest of {label}" if results else label)
            run.progress(label, len(results), n_inline)
            done = subprocess.run([sys.executable, "-c", ONE_PROCESS_EVAL], input=json.dumps([task, candidate]),
                                  capture_output=True, text=True, timeout=1800)
            ok = done.returncode == 0 and json.loads(done.stdout.strip().splitlines()[-1])["correct"]
            results.append(SimpleNamespace(status="correct" if ok else "failed"))
        _row(run, label, n_inline, results, time.perf_counter() - start, len(results) == n_inline)


def _inline_rows(run, build: str, workers: int, n: int, salt: str, cache_dir: str, timing: bool) -> None:
    """The load_inline rows for one build way, in a fresh build cache."""
    inline = [(task, INLINE_CANDIDATE.format(**f)) for task, f in variants(n, salt + "i" + build)]
    run.check(f"load_inline ({build} build)")
    with build_way(build), Verifier(workers=workers, cache_dir=cache_dir) as verifier:
        first = "cold build cache" + (" and precompiled header" if build == "fast" else "")
        how = "timing" if timing else "no timing"
        _map_row(run, verifier, f"load_inline ({build} build), warm pool, {first}, {how}", inline, timing=timing)
        _map_row(run, verifier, f"load_inline ({build} build), warm pool, warm build cache, {how}", inline,
                 timing=timing)
        if build == "fast":
            again = [(task, INLINE_CANDIDATE.format(**f)) for task, f in variants(n, salt + "j")]
            _map_row(run, verifier, f"load_inline (fast build), warm pool, cold build cache, {how}", again,
                     timing=timing)
            label = f"load_inline (fast build), BuildPool prebuild then verify, {how}"
            run.check(label)
            prebuilt = [(task, INLINE_CANDIDATE.format(**f)) for task, f in variants(n, salt + "p")]
            start = time.perf_counter()
            run.progress(f"{label}: prebuilding {n}")
            with BuildPool(cache_dir, timeout_s=900) as pool:
                reports = [f.result() for f in [pool.submit(candidate) for _, candidate in prebuilt]]
            built = time.perf_counter() - start
            busy = verifier.judge_busy_s
            results, seconds, complete = run.verify_map(verifier, prebuilt, label, timing=timing)
            _row(run, f"{label} (prebuild {built:.0f} s; {dict(collections.Counter(r['status'] for r in reports))})",
                 n, results, built + seconds, complete, (verifier.judge_busy_s - busy) / (built + seconds))


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m dice.bench verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=at_least(1), default=8, help="verifier worker processes")
    parser.add_argument("--kernels", type=at_least(1), default=32, help="CuPy kernels per CuPy row")
    parser.add_argument("--inline-kernels", type=at_least(1), default=4, help="load_inline kernels per load_inline row")
    parser.add_argument("--group-size", type=at_least(1), default=16,
                        help="kernels per task in the grouped row (DICE's RL step: 16)")
    parser.add_argument("--skip-one-process", action="store_true", help="skip the KernelBench-way row")
    parser.add_argument("--skip-timed", action="store_true", help="verify without timing only (the RL reward's way)")
    parser.add_argument("--check", metavar="JSON", help="instead verify the reference solutions in a DICE JSON file")
    parser.add_argument("--timing", action="store_true", help="with --check: also time each solution")
    parser.add_argument("--limit", type=at_least(1), help="with --check: only the first N solutions")
    parser.add_argument("--judges", type=at_least(1), help="with --check: reference processes (default: one per 4 workers)")
    parser.add_argument("--log", metavar="JSONL", help="with --check: append each verdict here; solutions "
                        "already logged are skipped (continue a run that was cut short; delete the file to start over)")
    parser.add_argument("--prebuild", action="store_true", help="with --check --build: build every solution "
                        "with a BuildPool (a process per core) before verifying it; prints build throughput and fallbacks")
    parser.add_argument("--build", choices=BUILDS, help="how load_inline extensions are built: torch's load_inline, "
                        "the fast split build, or both side by side (default: both for the bench; for --check the "
                        "verifier's default, fast, and both compares the verdicts)")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    if args.check and args.build and args.log:
        parser.error("--log resumes one run; with --build each way is verified afresh, so leave --log out")
    if args.log and args.check and Path(args.log).resolve() == Path(args.check).resolve():
        parser.error("argument --log: it is the --check file, which verdicts would be appended to; give another file")
    if not torch.cuda.is_available():
        sys.exit("error: python -m dice.bench verify needs a CUDA GPU, which this machine lacks; run it on a GPU machine")
    run = BenchRun("verify", args.budget_s, args.out)
    try:
        if args.check and args.build:
            compare_builds(run, args.check, args.workers, BUILDS[args.build], timing=args.timing, limit=args.limit,
                           prebuild=args.prebuild, judges=args.judges)
        elif args.check:
            check_reference_solutions(run, args.check, args.workers, timing=args.timing, limit=args.limit,
                                      log=args.log, judges=args.judges)
        else:
            args.build = args.build or "both"
            bench_verify(args, run)
    except BudgetSpent:
        pass
    finally:
        run.finish()


if __name__ == "__main__":
    fail_cleanly(main)
