"""Prebuilding candidates' load_inline extensions on the CPU, apart from the GPU workers (DESIGN.md §8).

    with BuildPool(verifier.cache_dir) as pool:
        future = pool.submit(candidate_src)      # later: the GPU worker's load_inline is a cache hit
        future.result()                          # a report, never a verdict

A GPU worker builds one candidate at a time, so a pool of 16 workers compiles at most 16
extensions at once however many cores are idle. `BuildPool` compiles ahead of them: each
submitted candidate is imported in a child process with `load_inline` replaced by the workers'
own `BuildCache.load_inline` (same cache folder, same key), stopped by a private exception once
its load_inline calls are built. Children are forked from a forkserver that has imported torch
(a child costs no torch import), lead their own session with no GPU visible (no CUDA context),
and are killed with everything they started when they finish or overrun `timeout_s`
(`keeper.kill_tree`). Compilers over all children and workers are bounded by the core count
(`fastbuild.CompilerSlots`). What a child reports is only information: a failed or killed
prebuild leaves the GPU worker to build and report the real compile_error itself.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import resource
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .keeper import kill_tree, set_child_subreaper

CHILD_FILE_BYTES = 2**30      # largest file a child may write (a build's objects)
REPORT_BYTES = 2**20


class _Built(Exception):
    """Raised in a child once the candidate's load_inline calls are built: stops its import."""


class BuildPool:
    """Prebuild candidates' extensions into `cache_dir`/torch_extensions, `processes` at a time.

    capability: the GPU's compute capability (default: GPU 0's); build: "fast" or "torch", as
    for `build.BuildCache`."""

    def __init__(self, cache_dir: str | Path, processes: int | None = None, timeout_s: float = 900.0, *,
                 capability: tuple[int, int] | None = None, build: str = "fast"):
        self.root = Path(cache_dir) / "torch_extensions"
        self.root.mkdir(parents=True, exist_ok=True)
        if capability is None and torch.cuda.is_available():
            capability = tuple(torch.cuda.get_device_capability(0))
        self.capability, self.build, self.timeout_s = capability, build, timeout_s
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["torch", "dice.verifier.build", "dice.verifier.harness"])
        self._pool = ThreadPoolExecutor(max_workers=processes or os.cpu_count() or 1,
                                        thread_name_prefix="dice-prebuild")

    def __enter__(self) -> "BuildPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, candidate_src: str) -> Future:
        """A Future of the prebuild's report: {"status": built | cached | failed | error | timeout |
        no build, "builds": BuildCache.history of the child, "seconds", "message"}."""
        if "load_inline" not in candidate_src:
            done: Future = Future()
            done.set_result({"status": "no build", "builds": [], "seconds": 0.0, "message": ""})
            return done
        return self._pool.submit(self._prebuild, candidate_src)

    def _prebuild(self, candidate_src: str) -> dict:
        start = time.perf_counter()
        reader, writer = self._context.Pipe(duplex=False)
        child = self._context.Process(target=_child, args=(writer, candidate_src, str(self.root), self.capability,
                                                           self.build), daemon=True)
        child.start()
        writer.close()
        report = {"status": "timeout", "builds": [], "message": f"prebuild killed after {self.timeout_s:.0f} s"}
        try:
            if reader.poll(self.timeout_s):
                report = json.loads(reader.recv_bytes(REPORT_BYTES))
        except (EOFError, OSError, ValueError) as exc:   # the child died, or wrote something else
            report = {"status": "error", "builds": [], "message": f"the prebuild process failed ({exc!r})"}
        finally:
            kill_tree(child.pid)
            child.join()
            reader.close()
        return {**report, "seconds": time.perf_counter() - start}


def _child(conn, candidate_src: str, root: str, capability, build: str) -> None:
    """Import the candidate with load_inline building into the cache; report as JSON."""
    os.setsid()
    set_child_subreaper()   # what the candidate starts stays below us for kill_tree
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    resource.setrlimit(resource.RLIMIT_FSIZE, (CHILD_FILE_BYTES, CHILD_FILE_BYTES))
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    import torch.utils.cpp_extension
    from .build import BuildCache, BuildError
    from .harness import load_module

    cache = BuildCache(Path(root), capability=tuple(capability) if capability else None, build=build)
    expected, calls = max(1, len(re.findall(r"\bload_inline\s*\(", candidate_src))), []

    def load_inline(*args, **kwargs):
        module = cache.load_inline(*args, **kwargs)
        calls.append(module)
        if len(calls) >= expected:
            raise _Built
        return module

    torch.utils.cpp_extension.load_inline = load_inline
    status, message = "no build", ""
    try:
        load_module(candidate_src, "candidate.py", "dice_prebuild_candidate")
    except _Built:
        pass
    except BuildError as exc:
        status, message = "failed", str(exc)
    except BaseException as exc:  # the candidate's own failure (or SystemExit): not ours to judge
        status, message = "error", f"{type(exc).__name__}: {str(exc)[:500]}"
    if status == "no build" and calls:
        status = "built" if cache.history else "cached"
    conn.send_bytes(json.dumps({"status": status, "builds": cache.history, "message": message}, default=str).encode())
    conn.close()
    sys.stdout.flush()
    os._exit(0)
