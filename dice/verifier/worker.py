"""The worker processes' main loop and the candidate role (DESIGN.md §8).

A worker serves one role (see `process.WorkerProcess`): "candidate" runs untrusted code
(`CandidateHandler`: build one candidate at a time, run its forward on seeded inputs, check the
rules that need the live process, ship outputs to the judge, run the timed calls it is asked
for on the judge's slots); "judge" is trusted and runs only task code (`judge.JudgeHandler`).
What crosses the pipes is in `wire`.

Trust (DESIGN.md §8.4): the candidate's worker is untrusted as a whole. What decides a verdict
comes from elsewhere: outputs are compared in the judge, times are taken by the trainer's clock
(`sealed`), timed inputs are the judge's. What the worker reports beyond outputs (its GPU records,
inputs it saw modified, threads left) is a claim, checked here in defence in depth: the harness
calls torch through `rules.trusted` (captured before any candidate code runs), and the worker
reports `invalid` (and is recycled) when a candidate replaced one of `rules.WATCHED` or any
function of the harness itself, the interpreter's callbacks (`guard.HarnessSnapshot`; an audit
hook refuses the interpreter's profile and trace hooks), or left threads or processes running;
GPU records leave it raw (`records`). Each worker leads its own process group, so a kill also ends
what a candidate started (compilers, subprocesses). A candidate can never make the judge accept
outputs it did not produce.
"""
from __future__ import annotations

import _thread
import faulthandler
import gc
import multiprocessing.connection
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

from . import guard, harness as harness_module, isolation, judge, kernels, outputs, records, rules, timing, wire
from .inline_build import cache, toolchain
from .inline_build.cache import BuildCache, BuildError, is_nvrtc_error, nvrtc_error_message
from .inline_build.pinned import valid_pins
from .epilogues import unfuse_activations
from .harness import (CANDIDATE_FILE, build_model, cuda_context_broken, describe_exception, init_device, load_module, load_task,
                      rewritten_in_place, trial_inputs)
from .isolation import global_flags, restore_global_flags
from .judge import JudgeHandler
from .keeper import kill_tree, reap, set_child_subreaper
from .kernels import CompiledKernels, gpu_activity, gpu_records, marker_name, matched_families
from .outputs import aliased_outputs, flatten, modified_inputs, same_bits, shared_outputs
from .precision import math_flags
from .rules import HarnessTampered, trusted
from .timing import CallRunner, open_slots
from .wire import export_tensor

WORKER_FILE_BYTES = 2**30       # largest file a worker may write (its log, a build): stops output floods
PRIVATE_CACHES = {"TORCH_EXTENSIONS_DIR": "torch_extensions", "TRITON_CACHE_DIR": "triton",
                  "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def serve(conn, role: str, config: dict, log_path: str, imported_s: float = 0.0) -> None:
    """Worker main loop (under `keeper.py`): one request dict in, one reply dict out, until None or EOF.
    The worker is a child subreaper too, so that what a candidate leaves running, a detached
    daemon included, stays below it and ends with the candidate (`_drop_candidate`)."""
    set_child_subreaper()
    resource.setrlimit(resource.RLIMIT_FSIZE, (WORKER_FILE_BYTES, WORKER_FILE_BYTES))
    # compilers' caches that torch, Triton and Inductor share through fixed folders, this process's own
    # (under the Verifier's log folder): what one candidate compiles or plants there reaches no other
    private = Path(log_path).with_name(f"private-{os.getpid()}")
    os.environ.update({name: str(private / folder) for name, folder in PRIVATE_CACHES.items()})
    # one CPU thread for torch's own ops: the work is the GPU's, and an OpenMP pool stopped by the
    # timing's SIGSTOP wakes milliseconds late (measured on a CPU: 3.8 ms a call, against 0.08)
    torch.set_num_threads(1)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout.reconfigure(line_buffering=True)
    faulthandler.enable()  # a segfault leaves a Python traceback in the log for the parent to quote
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1` a stuck worker: its stacks in its log
    started = time.perf_counter()
    handler = CandidateHandler(config) if role == "candidate" else JudgeHandler(config)
    # what a fresh process costs (DESIGN.md §8.4): the imports, then the CUDA context, probes and caches
    handler.info["startup_s"] = {"imports": imported_s, "init": time.perf_counter() - started}
    # bound now: a candidate that later replaces HarnessSnapshot.changed does not reach this call
    harness_changed = list
    if role == "candidate":
        # (not `toolchain`: its TRUSTED digests are set by each load)
        modules = (sys.modules[__name__], cache, guard, harness_module, isolation, judge, kernels, outputs, records,
                   rules, timing, wire)
        harness_changed = guard.HarnessSnapshot(handler, modules, guard.install()).changed
    send = multiprocessing.connection.Connection.send
    send(conn, {**handler.info, "pid": os.getpid()})
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone
            return
        if request is None:
            return
        try:
            reply = getattr(handler, request["op"])(request)
        except Exception as exc:  # a failure outside the candidate's code paths; keep serving
            reply = {"status": "runtime_error", "recycle": True,
                     "message": f"verifier {role} worker failed: {describe_exception(exc)}"}
        if request["op"] == "time_call" and reply["status"] == "ok":
            send(conn, reply)      # timed by the parent's clock: the checks below come with `timing_done`
            continue
        changed = harness_changed()
        if changed:
            reply = {"status": "invalid", "recycle": True, "message": f"the candidate replaced "
                     f"{', '.join(changed[:5])} in the verifier's worker; candidates must not modify the harness"}
        elif role == "candidate" and guard.live_children():
            reply = {"status": "invalid", "recycle": True, "message": "the candidate left processes running; all "
                     "work must finish inside forward, in the worker's own process"}
        send(conn, reply)


# ---------------------------------------------------------------------------------------------
# The candidate role.

class CandidateHandler:
    """Loads, runs and times one candidate at a time (requests: load, warmup, run, time_prepare,
    time_call, timing_done, unload; `wire` lists their fields)."""

    def __init__(self, config: dict):
        self.device = init_device(config["device"])
        self.cuda = self.device.type == "cuda"
        self.build_way = config.get("build")
        self.builds = BuildCache(Path(config["cache_dir"]) / "torch_extensions", self.device, build=self.build_way)
        self.builds.install()
        if self.cuda:   # an activation a library GEMM would fuse becomes a kernel the rule sees
            unfuse_activations()
        self.compiled = CompiledKernels()
        self.task = self.model = self.runner = None
        self.previous: list = []                 # the last call's inputs, rewritten in place by the next trial
        self.earlier: list = []                  # every output this candidate returned so far (a caller's)
        self.pending: list[torch.Tensor] = []  # shipped to the judge; alive until the next request
        self.loads = 0
        self.canary = torch.ones(1, device=self.device)   # copied to the host after each profiled forward
        # Starts CUPTI once, here, and checks that the profiler sees kernels at all.
        probe = lambda: torch.ones(1, device=self.device).add_(1)  # noqa: E731
        profiler_works = self.cuda and any(gpu_activity(probe)[1]["kernels"] for _ in range(2))
        self.info = {"device": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
                     "profiler_works": profiler_works, "provenance_works": not self.cuda or self.compiled.hooked,
                     "marker": marker_name() if self.cuda else "",
                     "matched": matched_families(self.device) if profiler_works else []}
        self.flags = global_flags()
        torch.ones(1 << 18).sum(), torch.ones(64, 64) @ torch.ones(64, 64)   # torch's CPU thread pools start now
        self.threads = set(threading.enumerate())  # the harness's own; any other is a candidate's
        self.thread_count = _thread._count()
        self.native = guard.native_threads()      # the process's threads before a candidate loads
        # what torch and the harness allocated so far lives as long as the worker: kept out of the
        # collections that free each candidate (a full one walked it all, ~0.1 s per candidate)
        gc.freeze()

    def load(self, request: dict) -> dict:
        """Import the task and the candidate and build ModelNew."""
        if self.task is not None:  # the previous candidate was not unloaded (its worker kept running)
            self._drop_candidate()
        self.native = guard.native_threads()   # lazily started library threads belong to the harness
        self.task, self.task_src = load_task(request["task_src"], "dice_task"), request["task_src"]
        math_flags(request["precision"])   # before the candidate's import: what it sets itself is its own
        # its builds in a folder of its own, the toolchain's shared artifacts checked against their
        # trusted build's digests (DESIGN.md §8.4)
        toolchain.TRUSTED = request.get("toolchain")
        if request.get("programs"):   # only what its prebuild made there (`pinned`), the kernels named from those bytes
            self.builds = BuildCache(self.builds.root, self.device, build=self.build_way,
                                     programs=Path(request["programs"]), pins=valid_pins(request.get("pins")),
                                     on_library=self.compiled.add_binary)
        self.builds.install()  # again: an earlier candidate may have replaced load_inline
        self.compiled.start([str(self.builds.programs)])
        self.loads += 1
        try:
            module = load_module(request["candidate_src"], CANDIDATE_FILE, f"dice_candidate_{self.loads}")
        except Exception as exc:
            return self._finish(self._load_error(exc))
        cls = getattr(module, "ModelNew", None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            return self._finish({"status": "invalid", "message": "the candidate defines no ModelNew "
                                 "nn.Module subclass; name the optimized class ModelNew"})
        if any(c is self.task.Model or c.__name__ == "Model" for c in cls.__mro__[1:]):
            return self._finish({"status": "invalid", "message": "ModelNew subclasses the reference Model; "
                                 "ModelNew must derive from nn.Module and compute forward with its own kernels"})
        try:
            self.model = build_model(self.task, cls, request["init_seed"], self.device)
        except Exception as exc:
            return self._finish(self._run_error(exc, "ModelNew(*get_init_inputs())"))
        return self._finish(self._threads_left("loading the module or ModelNew(*get_init_inputs())")
                            or {"status": "ok"})

    def warmup(self, request: dict) -> dict:
        """One forward whose outputs are not used, so that lazily compiled kernels (CuPy compiles at
        first launch) and one-time initialisation are behind the first profiled trial."""
        try:
            self.previous = rewritten_in_place([], trial_inputs(self.task, request["seed"], request["kind"], self.device,
                                                                       self.task_src))
            self.earlier = self._forward(self.previous, request["seed"])
        except Exception as exc:
            return self._finish(self._run_error(exc, "the first forward"))
        return self._finish(self._threads_left("the first forward") or {"status": "ok"})

    def run(self, request: dict) -> dict:
        """One correctness trial, as a caller uses forward: the trial's inputs written in place
        into the previous call's input tensors (outputs memoised by input address go stale), the
        forward profiled (`_watched`: the outputs read on torch's current stream at once, then a
        marker and the canary copy, `records.split_marker`); with `repeat` a second call on the same
        input values right after a call whose outputs are dropped, as a caller's loop calls
        (forward that skips work on calls in quick succession is caught: the profiled first call
        is not back to back with anything), whose outputs must not reuse the first call's memory,
        and after which the first call's outputs must be unchanged (a persistent output buffer
        overwrites what the caller holds). Outputs that changed after the caller's stream read them
        were still being written when forward returned. Inputs forward modified are shipped too:
        where the reference modifies an input in place, the candidate must leave it as the
        reference does."""
        self.pending = []
        seed = request["seed"]
        inputs = rewritten_in_place(self.previous, trial_inputs(self.task, seed, request["kind"], self.device,
                                                                self.task_src))
        self.previous = inputs
        originals = [trusted.clone(x) if isinstance(x, torch.Tensor) else None for x in inputs]
        found, second, stale = None, None, []
        try:
            if self.cuda:
                (outputs, read), found = gpu_records(lambda: self._watched(inputs, seed, profiled=True))
            else:
                outputs, read = self._watched(inputs, seed)
            unfinished = self._changed(outputs, read)
            if request["repeat"]:
                kept = [trusted.clone(t) if type(t) is torch.Tensor else None for t in outputs]
                restore = [x if o is None else o for o, x in zip(originals, inputs)]
                mutates = bool(modified_inputs(originals, inputs))
                if mutates:         # the later calls see the first call's input values
                    rewritten_in_place(inputs, restore)
                self._forward(inputs, seed)     # primes: the second call follows a call at once
                if mutates:
                    rewritten_in_place(inputs, restore)
                second, read = self._watched(inputs, seed)
                unfinished += [i for i in self._changed(second, read) if i not in unfinished]
                stale = [i for i, (k, t) in enumerate(zip(kept, outputs)) if k is not None and not same_bits(k, t)]
        except Exception as exc:
            return self._finish(self._run_error(exc, "forward"))
        for i, t in enumerate(outputs + (second or [])):
            if type(t) is not torch.Tensor:
                return self._finish({"status": "invalid", "message": f"output {i % len(outputs)} is a "
                                     f"{type(t).__name__}; forward must return torch.Tensor outputs"})
        left = self._threads_left("forward")
        if left:
            return self._finish(left)
        if unfinished:
            return self._finish({"status": "invalid", "message": f"output {unfinished[0]} changed after torch's "
                                 "current stream read it: work still running after forward returned (launched on "
                                 "another stream that the current stream does not wait for)"})
        calls = [outputs] + ([second] if second is not None else [])
        views = {i for i, _ in aliased_outputs(outputs, inputs)}   # judged as aliasing the inputs instead
        reused = sorted({i for k, call in enumerate(calls)
                         for i, _ in aliased_outputs(call, self.earlier + [t for c in calls[:k] for t in c])} - views)
        self.earlier += [t for call in calls for t in call]
        mutated = modified_inputs(originals, inputs)
        changed = [j for j in mutated if type(j) is int and 0 <= j < len(inputs)]   # a tampered list reaches the parent
        return self._finish({"status": "ok", "outputs": self._ship(outputs),
                             "second": self._ship(second) if second is not None else None,
                             "inputs": [[j, data] for j, data in zip(changed, self._ship([inputs[j] for j in changed]))],
                             "records": found, "own": sorted(self.compiled.names()) if self.cuda else None,
                             "mutated": mutated, "aliased": aliased_outputs(outputs, inputs),
                             "shared": shared_outputs(outputs),
                             "reused": reused, "stale": stale})

    def time_prepare(self, request: dict) -> dict:
        """A CallRunner on the judge's slots (`timing`), as a graph if asked and faithful; one timed
        forward's raw records (the timed path's kernels); a graph's outputs, shared."""
        self.pending, self.earlier, self.previous, self.runner = [], [], [], None
        try:
            inputs, outputs = open_slots(request["slots"])
            self.runner = CallRunner(self.model, inputs, outputs, self.device, request["method"])
            found = gpu_records(self.runner.forward)[1] if self.cuda else None
            static = self._share_graph_outputs()
        except Exception as exc:
            return self._finish(self._run_error(exc, "forward (while timing)"))
        return self._finish(self._threads_left("forward (while timing)") or {
            "status": "ok", "method": "graph" if static is not None else "eager", "records": found,
            "own": sorted(self.compiled.names()) if self.cuda else None, "outputs": static})

    def _share_graph_outputs(self) -> list | None:
        """A graph's static outputs for the judge, shared as they are (it reads every call's values
        there); None for eager calls, or a graph whose outputs torch cannot share (then timed
        eagerly: the parent asks both sides for eager calls)."""
        if self.runner.method != "graph":
            return None
        try:
            shared = [export_tensor(t, copy=False) for t in self.runner.outputs()]
        except Exception:
            return None
        self.pending += [t for _, t in shared]
        return [data for data, _ in shared]

    def time_call(self, request: dict) -> dict:
        """One timed call on the slots; the parent's clock times this request, so it does nothing
        else (`serve` leaves the harness checks to `timing_done`)."""
        try:
            self.runner.run()
        except Exception as exc:
            return self._finish(self._run_error(exc, "forward (while timing)"))
        return {"status": "ok"}

    def timing_done(self, request: dict) -> dict:
        """The end of a timing: its reply carries the checks `serve` left out of the timed calls' replies."""
        return self._finish(self._threads_left("forward (while timing)") or {"status": "ok"})

    def unload(self, request: dict) -> dict:
        """Drop the candidate; a native thread it started that still runs ends this worker
        (`recycle`), so it cannot reach the next candidate (a sibling of the same RL group)."""
        self._drop_candidate()
        left = guard.native_threads() - self.native
        return {"status": "ok", "recycle": bool(left)}

    def _forward(self, inputs: list, seed: int) -> list:
        trusted.manual_seed(seed)
        with trusted.no_grad():
            return flatten(self.model(*inputs))

    def _watched(self, inputs: list, seed: int, profiled: bool = False) -> tuple[list, list]:
        """(forward's outputs, copies of their bytes read on torch's current stream as soon as
        forward returned, before any synchronize, as the caller's next operation would read them).
        `profiled`: a marker and then the canary copy follow on the current stream
        (`records.split_marker`). `_changed` compares once the device is synchronized."""
        outputs = self._forward(inputs, seed)
        read = [trusted.clone(_memory(t)) if type(t) is torch.Tensor and t.is_cuda and t.numel() else None
                for t in outputs]
        if profiled:
            trusted.marker(0)
            trusted.to_host(self.canary)
        return outputs, read

    def _changed(self, outputs: list, read: list) -> list[int]:
        """The outputs whose bytes changed after the caller's stream read them (`_watched`): work
        that wrote them was still running when forward returned."""
        if self.cuda:
            trusted.cuda_synchronize(self.device)
        return [i for i, r in enumerate(read) if r is not None and not same_bits(r, _memory(outputs[i]))]

    def _ship(self, outputs: list) -> list[bytes]:
        """Outputs for the judge; the tensors stay alive until the next request (CUDA IPC)."""
        shipped = [export_tensor(t) for t in outputs]
        self.pending += [t for _, t in shipped]
        return [data for data, _ in shipped]

    def _threads_left(self, where: str) -> dict | None:
        """The verdict when candidate code left threads running (they outlive the candidate, so
        the worker is replaced), else None."""
        started = [t.name for t in threading.enumerate() if t not in self.threads and t.is_alive()]
        if _thread._count() > self.thread_count:   # also threads started with _thread.start_new_thread
            started.append(f"{_thread._count() - self.thread_count} started with _thread")
        if not started:
            return None
        return {"status": "invalid", "recycle": True, "message": f"{where} left background threads running "
                f"({', '.join(started[:5])}); all work must finish inside forward"}

    def _load_error(self, exc: Exception) -> dict:
        if isinstance(exc, HarnessTampered):
            return self._run_error(exc, "loading the candidate module")
        if isinstance(exc, SyntaxError):
            message = f"candidate.py line {exc.lineno}: SyntaxError: {exc.msg}"
        elif isinstance(exc, BuildError):
            message = str(exc)
        elif is_nvrtc_error(exc):
            message = nvrtc_error_message(exc)
        else:
            message = "the candidate module failed to load: " + describe_exception(exc)
        return {"status": "compile_error", "message": message}

    def _run_error(self, exc: Exception, what: str) -> dict:
        if is_nvrtc_error(exc) or isinstance(exc, BuildError):  # CuPy compiles lazily, at first launch
            return self._load_error(exc)
        if isinstance(exc, HarnessTampered):
            return {"status": "invalid", "recycle": True, "message": f"{what}: {exc}; candidates must not modify "
                    "the harness"}
        return {"status": "runtime_error", "message": f"{what} raised {describe_exception(exc)}"}

    def _finish(self, reply: dict) -> dict:
        # replaced torch or harness functions are caught for every reply in `serve` (HarnessSnapshot);
        # the candidate's GPU work is finished before any reply, so none of it overlaps another's timing
        if self.cuda:
            try:
                trusted.cuda_synchronize(self.device)
            except Exception:
                pass
        if reply["status"] in ("runtime_error", "compile_error") and cuda_context_broken(self.device):
            reply["recycle"] = True  # e.g. an illegal address: this CUDA context is unusable now
        return reply

    def _drop_candidate(self) -> None:
        kill_tree(os.getpid(), include_root=False)   # processes the candidate started, daemons included
        reap()
        self.pending, self.previous, self.earlier, self.model, self.task, self.runner = [], [], [], None, None, None
        for name in [m for m in sys.modules if m.startswith("dice_candidate_") or m == "dice_task"]:
            del sys.modules[name]
        restore_global_flags(self.flags)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def _memory(t: torch.Tensor) -> torch.Tensor:
    """The bytes of the memory `t` spans, as one dense uint8 tensor (a copy of it is a plain memcpy)."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.as_strided((span,), (1,), t.storage_offset()).view(torch.uint8)
