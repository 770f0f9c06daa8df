"""Prebuilding candidates' load_inline extensions on the CPU, apart from the GPU workers (DESIGN.md §8).

    with BuildPool(verifier.cache_dir) as pool:
        future = pool.submit(candidate_src)      # later: the GPU worker's load_inline is a cache hit
        future.result()                          # a report, never a verdict

A GPU worker builds one candidate at a time, so a pool of 16 workers compiles at most 16
extensions at once however many cores are idle. `BuildPool` compiles ahead of them: each
submitted candidate is imported in a child process with `load_inline` replaced by the workers'
own `BuildCache.load_inline` (same cache folder, same key), stopped by a private exception once
its load_inline calls are built. The children are forked by a build server, `python -m
dice.verifier.inline_build.pool`, started with `subprocess` (so the caller's script is never imported
again: no `__main__` guard is needed) with no GPU visible, which has imported torch once (a child
costs no torch import) and runs at a lower CPU priority (`BUILD_NICE`: compilers take idle cores and
yield contended ones to the threads that keep the GPU busy). Each child leads its own session and is killed
with everything it started when it finishes or overruns `timeout_s` (`keeper.kill_tree`); the
server ends its children and itself when its input closes (the pool closed, or its owner died).
Compilers over all children and workers are bounded by the core count (`toolchain.CompilerSlots`).
What a child reports is only information: a failed or killed prebuild leaves the GPU worker to
build and report the real compile_error itself.

Shared units (DESIGN.md §8.4): a child whose candidate makes one load_inline call reports its
arguments ("delegate") instead of building; the server then forks a trusted builder
(`_build_delegated`), which runs no candidate code and alone holds `SEAL`, the key of the compiled
units every trusted build shares (`fast.CompiledUnits`): an RL group compiles its host unit once.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import NoReturn

import torch

from ..keeper import POLL_S, kill_tree, set_child_subreaper

CHILD_FILE_BYTES = 2**30      # largest file a child may write (a build's objects)
# the build server's CPU priority, inherited by its children and their compilers: builds fill idle
# cores but yield them to what keeps the GPU busy (the trainer's generating thread, the GPU workers,
# the judges), which run at the default 0; under Linux's CFS a nice-10 process weighs ~1/10 of one at 0
BUILD_NICE = 10
REPORT_BYTES = 2**20
PR_SET_DUMPABLE = 4   # prctl's option (linux/prctl.h)
# the server forks a child per build, and a fork copies no thread but the caller (a lock another
# thread held then is never released in the child), so it runs one: no GPU, torch's CPU pools at one
# thread, and torch.cuda.is_available() (asked by torch.utils.cpp_extension's import) answered by
# NVML, not by cuInit, which starts a driver thread even when no GPU is visible
SERVER_ENV = {"CUDA_VISIBLE_DEVICES": "", "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "OMP_NUM_THREADS": "1",
              "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# the key of the shared compiled units (`fast.CompiledUnits`): read by `serve` into this buffer in
# place (no copy left in the heap its children inherit), zeroed in every child before candidate
# code runs there, and copied only in trusted builders, which run none (DESIGN.md §8.4)
SEAL = bytearray(32)


class _Built(Exception):
    """Raised in a child once the candidate's load_inline calls are built: stops its import."""


class BuildPool:
    """Prebuild candidates' extensions into `cache_dir`/torch_extensions, `processes` at a time.

    capability: the GPU's compute capability (default: GPU 0's); build: "fast" or "torch", as
    for `cache.BuildCache`."""

    def __init__(self, cache_dir: str | Path, processes: int | None = None, timeout_s: float = 900.0, *,
                 capability: tuple[int, int] | None = None, build: str = "fast"):
        self.root = Path(cache_dir) / "torch_extensions"
        self.root.mkdir(parents=True, exist_ok=True)
        if capability is None and torch.cuda.is_available():
            capability = tuple(torch.cuda.get_device_capability(0))
        self.capability, self.build, self.timeout_s = capability, build, timeout_s
        self.processes = processes or os.cpu_count() or 1
        self._server: subprocess.Popen | None = None
        self._futures: dict[int, Future] = {}
        self._lock, self._next = threading.Lock(), 0
        self._warm: Future | None = None

    def __enter__(self) -> "BuildPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the server (it kills the children still building); pending reports say so."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stdin.close()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_tree(server.pid)
                server.wait()
        self._fail_pending("the build pool was closed")

    @property
    def pending(self) -> int:
        """Prebuilds submitted whose report has not come (queued in the server, or building)."""
        return len(self._futures)

    def submit(self, candidate_src: str, programs: Path | None = None) -> Future:
        """A Future of the prebuild's report: {"status": built | cached | failed | error | timeout |
        no build, "builds": BuildCache.history of the child, "seconds", "message"}. `programs`: the
        candidate's own folder for its libraries (`cache.BuildCache`; default the shared root)."""
        if "load_inline" not in candidate_src:
            done: Future = Future()
            done.set_result({"status": "no build", "builds": [], "seconds": 0.0, "message": ""})
            return done
        return self._send({"candidate_src": candidate_src, "programs": str(programs or self.root),
                           "toolchain": self.toolchain()})

    def warm(self) -> Future:
        """The fast build's toolchain artifacts (precompiled headers, dispatcher, header names) built
        by a child now, ahead of the first candidate, which would otherwise wait ~30 s for them
        (`cache.BuildCache.warm`); a Future of the report ({"status": "warmed", "toolchain": their
        files' digests} or "error"). The child runs no candidate code: what it built is what every
        later build checks the shared cache's artifacts against (`toolchain.TRUSTED`)."""
        self._warm = self._send({"candidate_src": None})
        return self._warm

    def toolchain(self, wait: bool = True) -> dict | None:
        """The digests `warm` reported ({} if it failed or took too long), or None without a warm-up
        (then builds trust the shared cache as they find it). `wait=False`, for a candidate with no
        load_inline program found in its source, which builds nothing the warm-up would speed up:
        {} while the warm-up runs (a build it starts some other way trusts nothing shared)."""
        if self._warm is None:
            return None
        if not wait and not self._warm.done():
            return {}
        try:
            return self._warm.result(timeout=self.timeout_s).get("toolchain") or {}
        except FuturesTimeout:
            return {}

    def _send(self, request: dict) -> Future:
        done: Future = Future()
        request = {**request, "root": str(self.root), "capability": self.capability, "build": self.build,
                   "timeout_s": self.timeout_s}
        with self._lock:
            self._next += 1
            self._futures[self._next] = done
            try:
                self._started().stdin.write(json.dumps({"id": self._next, **request}) + "\n")
                self._server.stdin.flush()
            except OSError as exc:
                self._futures.pop(self._next)
                done.set_result({"status": "error", "builds": [], "seconds": 0.0,
                                 "message": f"the build server is gone ({exc!r})"})
        return done

    def _started(self) -> subprocess.Popen:
        if self._server is None:
            env = {**os.environ, **SERVER_ENV}
            self._server = subprocess.Popen([sys.executable, "-m", "dice.verifier.inline_build.pool",
                                             str(self.processes)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            threading.Thread(target=self._read, args=(self._server,), daemon=True,
                             name="dice-prebuild-reader").start()
        return self._server

    def _read(self, server: subprocess.Popen) -> None:
        try:
            for line in server.stdout:
                try:
                    reply = json.loads(line)
                    future = self._futures.pop(reply.pop("id"))
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
                if not future.done():
                    future.set_result(reply)
        finally:    # whatever ended this thread, no report waits for it
            self._fail_pending("the build server ended")

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            pending, self._futures = self._futures, {}
        for future in pending.values():
            if not future.done():
                future.set_result({"status": "error", "builds": [], "seconds": 0.0, "message": why})


def serve(processes: int) -> None:
    """The build server: JSON request lines on stdin, one forked child each (at most `processes`
    at once), JSON report lines on stdout; ends its children and itself when stdin closes. It runs
    at BUILD_NICE."""
    with contextlib.suppress(OSError):   # a sandbox that refuses it builds at the owner's priority
        os.nice(max(0, BUILD_NICE - os.nice(0)))
    urandom = os.open("/dev/urandom", os.O_RDONLY)
    os.readv(urandom, [SEAL])
    os.close(urandom)
    with contextlib.suppress(OSError, AttributeError):   # no other process of the user reads our memory
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    # imported once here, not in every child, nor in the trainer that imports this module for BuildPool
    import torch.utils.cpp_extension
    if torch.utils.cpp_extension.CUDA_HOME is None and os.environ.get("CUDA_HOME"):
        # a CPU-only torch beside a CUDA toolkit (builds for a given capability, as `bench builds`)
        torch.utils.cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]
    from . import cache  # noqa: F401
    from .. import harness  # noqa: F401
    set_child_subreaper()
    selector, queue, running, pending = selectors.DefaultSelector(), [], {}, b""
    selector.register(0, selectors.EVENT_READ, "requests")
    while True:
        while queue and len(running) < processes:
            request = queue.pop(0)
            reader, writer = os.pipe()
            pid = os.fork()
            if pid == 0:
                for fd in (reader, *running):
                    os.close(fd)
                # the requests pipe is not the child's; a closed fd 0 would make nvcc fail to preprocess
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.close(null)
                _child(writer, request)
            os.close(writer)
            running[reader] = (pid, request, time.monotonic(), [])
            selector.register(reader, selectors.EVENT_READ, "report")
        deadline = min((start + r["timeout_s"] for _, r, start, _ in running.values()), default=None)
        for key, _ in selector.select(None if deadline is None else max(0.0, deadline - time.monotonic())):
            chunk = os.read(key.fd, 65536)
            if key.data == "requests":
                if not chunk:   # the pool closed, or its owner died
                    for pid, *_ in running.values():
                        kill_tree(pid)
                    return
                *lines, pending = (pending + chunk).split(b"\n")
                queue += [json.loads(line) for line in lines if line.strip()]
            else:
                running[key.fd][3].append(chunk)
                if not chunk or b"\n" in chunk:    # a report is one line; the child then waits to be killed
                    queue[:0] = _finish(selector, running, key.fd, None)   # a delegated build next
        for fd, (_, request, start, _) in list(running.items()):
            if time.monotonic() > start + request["timeout_s"]:
                _finish(selector, running, fd, f"prebuild killed after {request['timeout_s']:.0f} s")


def _finish(selector, running: dict, fd: int, timed_out: str | None) -> list[dict]:
    """Kill a child and everything it started (it is their subreaper), and send its report; or,
    for a child that delegated its build, the request that follows it instead (`_follow_up`)."""
    pid, request, start, chunks = running.pop(fd)
    selector.unregister(fd)
    os.close(fd)
    kill_tree(pid)
    os.waitpid(pid, 0)
    report = {"status": "timeout", "builds": [], "message": timed_out}
    if timed_out is None:
        try:
            report = json.loads(b"".join(chunks).split(b"\n")[0][:REPORT_BYTES])
        except ValueError as exc:   # the child died, or wrote something else
            report = {"status": "error", "builds": [], "message": f"the prebuild process failed ({exc!r})"}
    since = request.get("since", start)
    follow = _follow_up(request, report, since)
    if follow:
        return follow
    sys.stdout.write(json.dumps({"id": request["id"], **report, "seconds": time.monotonic() - since}, default=str) + "\n")
    sys.stdout.flush()
    return []


def _follow_up(request: dict, report: dict, since: float) -> list[dict]:
    """What runs after a child's report instead of sending it: a candidate's child that delegated its
    one load_inline call ("delegate", with the call's arguments) is followed by a trusted build of
    them; a trusted build the fast way cannot do ("unsplittable") by the candidate's child again,
    building in its own process as before. Each keeps the request's id and first start."""
    if report.get("status") == "delegate" and isinstance(report.get("arguments"), dict) \
            and request.get("arguments") is None:
        return [{**request, "arguments": report["arguments"], "since": since}]
    if report.get("status") == "unsplittable" and request.get("arguments") is not None:
        return [{**request, "arguments": None, "delegate": False, "since": since}]
    return []


def _die_with(server: int) -> None:
    """In a build child: once its server is gone (even SIGKILLed, so that no stdin closes and no
    `_finish` comes), kill everything below this child and exit; polled every POLL_S."""
    while os.getppid() == server:
        time.sleep(POLL_S)
    kill_tree(os.getpid(), include_root=False)
    os._exit(1)


def _child(report_fd: int, request: dict) -> None:
    """Import the candidate with load_inline building into its programs' folder, checking the
    toolchain's artifacts against the warm-up's digests (`toolchain.TRUSTED`); with no candidate,
    warm the toolchain and report its digests. Report as JSON."""
    candidate_src, root, capability, build = (request["candidate_src"], request["root"], request["capability"],
                                              request["build"])
    threading.Thread(target=_die_with, args=(os.getppid(),), daemon=True).start()
    os.setsid()
    set_child_subreaper()   # what the candidate starts stays below us for kill_tree
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    resource.setrlimit(resource.RLIMIT_FSIZE, (CHILD_FILE_BYTES, CHILD_FILE_BYTES))
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    if request.get("arguments") is not None:
        _build_delegated(report_fd, request)
    SEAL[:] = bytes(len(SEAL))   # before any candidate code runs in this process
    # cache hits: the server loaded them before it forked (`serve`), not at the top, where the trainer would
    import torch.utils.cpp_extension
    from .cache import BuildCache, BuildError
    from ..harness import load_module

    from . import toolchain

    if candidate_src is None:   # `BuildPool.warm`
        cache = BuildCache(Path(root), capability=tuple(capability) if capability else None, build=build)
        status, message = "warmed", ""
        try:
            cache.warm()
        except Exception as exc:
            status, message = "error", f"{type(exc).__name__}: {str(exc)[:500]}"
        _report(report_fd, {"status": status, "builds": [], "message": message,
                            "toolchain": toolchain.artifact_digests(Path(root))})
    toolchain.TRUSTED = request.get("toolchain")
    cache = BuildCache(Path(root), capability=tuple(capability) if capability else None, build=build,
                       programs=Path(request.get("programs") or root), pins=_pins(request))
    expected, calls = max(1, len(re.findall(r"\bload_inline\s*\(", candidate_src))), []
    delegate = expected == 1 and build == "fast" and request.get("delegate", True)

    def load_inline(*args, **kwargs):
        if delegate:   # its one call built by a trusted builder (`_build_delegated`), where it can
            with contextlib.suppress(TypeError, ValueError):   # be plain data in a report
                report = {"status": "delegate", "arguments": cache.arguments(*args, **kwargs)}
                if len(json.dumps(report)) < REPORT_BYTES:
                    _report(report_fd, report)
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
    _report(report_fd, {"status": status, "builds": cache.history, "message": message, "pins": cache.made})


def _pins(request: dict) -> dict | None:
    """{} in a candidate's own folder (its builds there trust nothing found on disk, `pinned`), else None."""
    return {} if request.get("programs") not in (None, request["root"]) else None


def _build_delegated(report_fd: int, request: dict) -> NoReturn:
    """A trusted builder (DESIGN.md §8.4): builds a candidate's one load_inline call from the arguments
    its child reported, the fast way and without importing it, so nothing the candidate wrote runs
    in this process, which alone holds the seal of the shared compiled units (`SEAL`): an RL group's
    programs compile their common host unit once. Reports "built", "cached", "failed" (a compile
    error torch's build shares), "unsplittable" (only torch's build would do: the candidate's child
    then builds it as before, `_follow_up`) or "error"."""
    from . import toolchain
    from .cache import BuildCache, BuildError
    from .fast import FastBuildFailed
    from .inline import Unsplittable

    toolchain.TRUSTED = request.get("toolchain")
    root, capability = Path(request["root"]), request["capability"]
    cache = BuildCache(root, capability=tuple(capability) if capability else None, build="fast",
                       programs=Path(request.get("programs") or root), units=root, seal=bytes(SEAL),
                       pins=_pins(request))
    status, message = "error", ""
    try:
        status = cache.build_only(request["arguments"])
    except BuildError as exc:
        status, message = "failed", str(exc)
    except (Unsplittable, FastBuildFailed) as exc:
        status, message = "unsplittable", f"{type(exc).__name__}: {str(exc)[:500]}"
    except Exception as exc:
        message = f"{type(exc).__name__}: {str(exc)[:500]}"
    _report(report_fd, {"status": status, "builds": cache.history, "message": message, "pins": cache.made})


def _report(report_fd: int, report: dict) -> NoReturn:
    """Write a child's one-line report, then wait to be killed by the server (with everything the
    candidate started below us): never returns."""
    with os.fdopen(report_fd, "w") as out:
        out.write(json.dumps(report, default=str)[:REPORT_BYTES] + "\n")
    while True:
        signal.pause()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
