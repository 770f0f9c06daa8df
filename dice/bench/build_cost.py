"""load_inline build cost per program: `python -m dice.bench builds --solutions FILE.json`.

Compiles and links the first load_inline call of every reference solution in a DICE JSON file
the fast way (DESIGN.md §8.5), once per binding ("dispatch": the generic binding; "pybind":
torch's PYBIND11_MODULE), `--jobs` programs at a time, each binding in a fresh cache whose
precompiled header and dispatcher are built (and timed) first. Prints per binding the programs
built, the median CPU seconds of host unit, device unit and link, programs per minute of wall
time, and the first error line of each that did not build (which the verifier would then build
with torch's load_inline). Nothing is loaded, so it runs without a GPU: with a CPU-only torch the
CUDA libraries torch would link are left out (the programs' own -l flags stay) and nvcc is taken
from /usr/local/cuda. The solutions' module-level code runs up to their load_inline call:
trusted reference files only.

`--group N` builds what the RL reward builds: each reference as an RL group of N programs, salted
and 30% broken as `bench rl` replays them (`replay.replay_programs`), every program submitted at
once, `--jobs` at a time (default 16, the verifier's prebuild children on one H200's host) with
compilers bounded by this machine's cores (`toolchain.CompilerSlots`). `--units`: where compiled
units are kept, "own" (each program's folder: no program uses another's, as the verifier built
before its trusted builds, and still builds what a candidate's own process builds) or "shared" (one
store for all, as the verifier's trusted builds share sealed units: a group's programs share their
host unit); the row counts the host units compiled.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from ..cli import at_least
from ..tasks.load import load_tasks
from ..verifier.inline_build import fast, toolchain
from ..verifier.inline_build.cache import BuildCache
from ..verifier.inline_build.fast import FastBuildFailed, SharedCompileError
from ..verifier.inline_build.inline import Unsplittable
from ..verifier.inline_build.toolchain import CompilerSlots, Flags
from ..verifier.inline_build.torch_inline import recorded_calls
from .replay import BROKEN, replay_programs

CPU_ONLY_LIBRARIES = ("-lc10_cuda", "-ltorch_cuda")


def _flags(arguments: dict, capability: tuple[int, int]) -> Flags:
    flags = Flags(arguments, "ext", capability)
    if torch.version.cuda is None:
        flags.ldflags = [f for f in flags.ldflags if f not in CPU_ONLY_LIBRARIES]
    return flags


def build_one(call: dict, binding: str, root: Path, folder: Path, capability: tuple[int, int],
              slots: CompilerSlots, units: Path | None = None) -> dict:
    """Compile and link one load_inline call; {"built": bool, CPU seconds or "error"}; `units`: where
    its compiled units are kept (None: `root`, shared)."""
    arguments = BuildCache(root, capability=capability, build="fast").arguments(**call)
    try:
        _, report = fast.fast_build(arguments, "ext", folder, root, capability, slots,
                                    flags=_flags(arguments, capability), binding=binding, units=units)
    except (Unsplittable, FastBuildFailed, SharedCompileError) as exc:
        first = next((line for line in str(exc).splitlines() if "error" in line), str(exc).strip()[:200])
        return {"built": False, "error": f"{type(exc).__name__}: {first.replace(str(folder) + '/', '')}"[:240]}
    return {"built": True, "binding": report["binding"], "host": report["host_cpu_s"], "device": report["device_cpu_s"],
            "link": report["link_cpu_s"]}


def _warm(root: Path, call: dict, binding: str, capability: tuple[int, int], slots: CompilerSlots) -> float:
    """Build the cache's one-time artifacts (precompiled header, dispatcher) for `binding`; seconds."""
    start = time.perf_counter()
    flags = _flags(BuildCache(root, capability=capability, build="fast").arguments(**call), capability)
    toolchain.torch_macros(root, flags)
    toolchain.precompiled_header(root, flags, slots, binding)
    if binding == "dispatch":
        toolchain.dispatcher(root, flags, slots)
    return time.perf_counter() - start


def bench_builds(args, bench) -> None:
    if cpp_extension.CUDA_HOME is None and Path("/usr/local/cuda/bin/nvcc").exists():
        cpp_extension.CUDA_HOME = "/usr/local/cuda"
    capability = tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else tuple(args.arch)
    jobs = args.jobs or (16 if args.group else os.cpu_count() or 1)
    tasks = [t for t in load_tasks(args.solutions) if t.solution][:args.limit]
    if not tasks:
        raise SystemExit(f"error: {args.solutions}: no record has a cuda_code program (the key that holds a task's "
                         "reference solution); pass a DICE JSON file whose records hold one")
    if args.group:
        tasks = [owner for owner, _ in replay_programs(tasks, args.group, BROKEN, seed=0, run=0)]
    calls = [(t.name, (recorded_calls(t.solution) or [None])[0]) for t in tasks]
    calls = [(name, call) for name, call in calls if call is not None]
    if not calls:
        raise SystemExit(f"error: {args.solutions}: none of its {len(tasks)} cuda_code programs builds a CUDA extension "
                         "with torch's load_inline, the builds this command times (CuPy programs compile as they "
                         "run); pass a file of load_inline programs, e.g. DICE's kernel_infilling_evaluation.json")
    print(f"{len(calls)} programs, sm_{capability[0]}{capability[1]}, {jobs} at a time"
          + (f", groups of {args.group}, compilers bounded by {os.cpu_count()} cores" if args.group else "")
          + (", units kept in each program's folder" if args.units == "own" else ", units kept in one shared store")
          + ("; CPU-only torch: linked without " + " ".join(CPU_ONLY_LIBRARIES) if torch.version.cuda is None else ""))
    for binding in args.binding:
        bench.check(f"the {binding} binding")
        with tempfile.TemporaryDirectory(prefix=f"dice-builds-{binding}-") as cache:
            root, slots = Path(cache), CompilerSlots(Path(cache), None if args.group else jobs)
            bench.progress(f"{binding}: precompiled header and dispatcher")
            once = _warm(root, calls[0][1], binding, capability, slots)
            start, results = time.perf_counter(), [None] * len(calls)

            def job(i):
                if bench.left() <= 0:   # the budget is spent: no new build starts
                    return
                (root / f"p{i}").mkdir()
                units = root / f"p{i}" if args.units == "own" else None
                results[i] = build_one(calls[i][1], binding, root, root / f"p{i}", capability, slots, units)
                bench.progress(f"{binding}: programs built", sum(r is not None for r in results), len(calls))
            with ThreadPoolExecutor(jobs) as pool:
                list(pool.map(job, range(len(calls))))
            wall = time.perf_counter() - start
        done = [r for r in results if r is not None]
        built = [r for r in done if r["built"]]
        medians = {k: statistics.median([r[k] for r in built]) if built else float("nan") for k in ("host", "device", "link")}
        cpu = statistics.median([r["host"] + r["device"] + r["link"] for r in built]) if built else float("nan")
        bench.row({"binding": binding, "built": f"{len(built)}/{len(done)}", "programs": len(calls),
                   "seconds": f"{wall:.0f}", "programs/min": f"{60 * len(done) / wall:.1f}",
                   "header+dispatcher s": f"{once:.0f}", "CPU s host": f"{medians['host']:.2f}",
                   "device": f"{medians['device']:.2f}", "link": f"{medians['link']:.2f}",
                   "per program": f"{cpu:.2f}", "host units compiled": sum(r["host"] > 0 for r in built)},
                  partial=len(done) < len(calls))
        for (name, _), r in zip(calls, results):
            if r is not None and not r["built"]:
                print(f"  - {name}: {r['error']}")
        if len(done) < len(calls):
            bench.check(f"the rest of the {binding} binding")


def add_arguments(b) -> None:
    b.add_argument("--solutions", required=True, metavar="JSON", help="a DICE JSON file with cuda_code references")
    b.add_argument("--binding", nargs="+", choices=("dispatch", "pybind"), default=["dispatch", "pybind"],
                   help="bindings to build with, in this order")
    b.add_argument("--jobs", type=at_least(1), default=None,
                   help="programs built at once (default: the CPU count; 16 with --group)")
    b.add_argument("--group", type=at_least(2), default=None, metavar="N",
                   help="each reference as an RL group of N salted programs, 30%% broken, submitted at once")
    b.add_argument("--limit", type=at_least(1), help="only the first N solutions")
    b.add_argument("--units", choices=("own", "shared"), default="own",
                   help="where compiled units are kept: own (each program's folder) or shared (one store, as the "
                        "verifier's trusted builds: a group's programs share their host unit)")
    b.add_argument("--arch", type=at_least(0), nargs=2, default=(9, 0), metavar=("MAJOR", "MINOR"),
                   help="the architecture to build for without a GPU (default: 9 0, Hopper)")
