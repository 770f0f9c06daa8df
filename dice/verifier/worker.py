"""The worker processes' main loop and the candidate role (DESIGN.md §8).

A worker serves one role (see `process.WorkerProcess`): "candidate" runs untrusted code
(`CandidateHandler`: build one candidate at a time, run its forward on seeded inputs, check the
rules that need the live process, ship outputs to the judge, time itself when asked); "judge" is
trusted and runs only task code (`judge.JudgeHandler`). What crosses the pipes is in `protocol`.

Trust: the harness calls torch through `checks.trusted` (captured before any candidate code
runs). The candidate worker reports `invalid` (and is recycled) when a candidate replaced one of
`checks.WATCHED` or any function of the harness itself, the interpreter's callbacks
(`guard.HarnessSnapshot`; an audit hook refuses the interpreter's profile and trace hooks), or
left threads or processes running; GPU records leave it raw (`records`). Each worker leads its own process group, so a kill also ends what a candidate started
(compilers, subprocesses). Workers are a boundary against crashes, hangs and reward hacks, not an
OS sandbox (README, limits). A candidate can never make the judge accept outputs it did not produce.
"""
from __future__ import annotations

import _thread
import faulthandler
import gc
import multiprocessing.connection
import os
import resource
import sys
import threading
from pathlib import Path

import torch
from torch import nn

from . import build, checks, guard, harness as harness_module, judge, kernels, protocol, records, timing
from .build import BuildCache, BuildError, is_nvrtc_error, nvrtc_error_message
from .checks import HarnessTampered, aliased_outputs, flatten, modified_inputs, same_bits, trusted
from .harness import (build_model, cuda_context_broken, describe_exception, init_device, load_module, load_task,
                      make_inputs, rewritten_in_place, trial_inputs)
from .judge import JudgeHandler
from .keeper import kill_tree, reap, set_child_subreaper
from .kernels import CompiledKernels, gpu_activity, gpu_records, marker_name
from .precision import math_flags
from .protocol import export_tensor
from .timing import Timer

WORKER_FILE_BYTES = 2**30       # largest file a worker may write (its log, a build): stops output floods


def serve(conn, role: str, config: dict, log_path: str) -> None:
    """Worker main loop (under `keeper.py`): one request dict in, one reply dict out, until None or EOF.
    The worker is a child subreaper too, so that what a candidate leaves running, a detached
    daemon included, stays below it and ends with the candidate (`_drop_candidate`)."""
    set_child_subreaper()
    resource.setrlimit(resource.RLIMIT_FSIZE, (WORKER_FILE_BYTES, WORKER_FILE_BYTES))
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout.reconfigure(line_buffering=True)
    faulthandler.enable()  # a segfault leaves a Python traceback in the log for the parent to quote
    handler = CandidateHandler(config) if role == "candidate" else JudgeHandler(config)
    # bound now: a candidate that later replaces HarnessSnapshot.changed does not reach this call
    harness_changed = list
    if role == "candidate":
        modules = (sys.modules[__name__], build, checks, guard, harness_module, judge, kernels, protocol, records,
                   timing)
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
    time_block, unload; `protocol` lists their fields)."""

    def __init__(self, config: dict):
        self.device = init_device(config["device"])
        self.cuda = self.device.type == "cuda"
        self.builds = BuildCache(Path(config["cache_dir"]) / "torch_extensions", self.device, build=config.get("build"))
        self.builds.install()
        self.compiled = CompiledKernels()
        self.task = self.model = self.timer = None
        self.previous: list = []                 # the last call's inputs, rewritten in place by the next trial
        self.earlier: list = []                  # every output this candidate returned so far (a caller's)
        self.pending: list[torch.Tensor] = []  # shipped to the judge; alive until the next request
        self.loads = 0
        # Starts CUPTI once, here, and checks that the profiler sees kernels at all.
        probe = lambda: torch.ones(1, device=self.device).add_(1)  # noqa: E731
        profiler_works = self.cuda and any(gpu_activity(probe)[1]["kernels"] for _ in range(2))
        self.info = {"device": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
                     "profiler_works": profiler_works, "provenance_works": not self.cuda or self.compiled.hooked,
                     "marker": marker_name() if self.cuda else ""}
        self.flags = _global_flags()
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
        self.task = load_task(request["task_src"], "dice_task")
        math_flags(request["precision"])   # before the candidate's import: what it sets itself is its own
        self.builds.install()  # again: an earlier candidate may have replaced load_inline
        self.compiled.start([str(self.builds.root)])
        self.loads += 1
        try:
            module = load_module(request["candidate_src"], "candidate.py", f"dice_candidate_{self.loads}")
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
            self.previous = rewritten_in_place([], trial_inputs(self.task, request["seed"], request["kind"], self.device))
            self.earlier = self._forward(self.previous, request["seed"])
        except Exception as exc:
            return self._finish(self._run_error(exc, "the first forward"))
        return self._finish(self._threads_left("the first forward") or {"status": "ok"})

    def run(self, request: dict) -> dict:
        """One correctness trial, as a caller uses forward: the trial's inputs written in place
        into the previous call's input tensors (outputs memoised by input address go stale), the
        forward profiled and followed by a marker on torch's current stream (`records.split_marker`:
        work still running when forward returned); with `repeat` a second call on the same inputs,
        whose outputs must not reuse the first call's memory, and after which the first call's
        outputs must be unchanged (a persistent output buffer overwrites what the caller holds);
        it also reports outputs still being written after torch's current stream finished."""
        self.pending = []
        seed = request["seed"]
        inputs = rewritten_in_place(self.previous, trial_inputs(self.task, seed, request["kind"], self.device))
        self.previous = inputs
        originals = [trusted.clone(x) if isinstance(x, torch.Tensor) else None for x in inputs]
        found, second, not_ready, stale = None, None, [], []
        try:
            if self.cuda:
                outputs, found = gpu_records(lambda: self._forward(inputs, seed, marked=True))
            else:
                outputs = self._forward(inputs, seed)
            if request["repeat"]:
                kept = [trusted.clone(t) if type(t) is torch.Tensor else None for t in outputs]
                second, not_ready = self._call_watching_streams(inputs, seed)
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
        if not_ready:
            return self._finish({"status": "invalid", "message": f"output {not_ready[0]} was still being "
                                 "written after torch's current stream finished: forward launched work on "
                                 "another stream without making the current stream wait for it"})
        calls = [outputs] + ([second] if second is not None else [])
        views = {i for i, _ in aliased_outputs(outputs, inputs)}   # judged as aliasing the inputs instead
        reused = sorted({i for k, call in enumerate(calls)
                         for i, _ in aliased_outputs(call, self.earlier + [t for c in calls[:k] for t in c])} - views)
        self.earlier += [t for call in calls for t in call]
        return self._finish({"status": "ok", "outputs": self._ship(outputs),
                             "second": self._ship(second) if second is not None else None,
                             "records": found, "own": sorted(self.compiled.names()) if self.cuda else None,
                             "mutated": modified_inputs(originals, inputs), "aliased": aliased_outputs(outputs, inputs),
                             "reused": reused, "stale": stale})

    def time_prepare(self, request: dict) -> dict:
        """A Timer on the timing seed's inputs, as a graph if asked and faithful; its kernels."""
        self.pending, self.earlier, self.previous = [], [], []
        try:
            pristine = make_inputs(self.task, request["seed"], self.device)
            self.timer = Timer(self.model, pristine, request["seed"], self.device, request["method"], request["inputs"])
            found = self.timer.profile() if self.cuda else None
            probe = self.timer.block(-10, 1, 0.0, profiled=False)
        except Exception as exc:
            return self._finish(self._run_error(exc, "forward (while timing)"))
        return self._finish(self._threads_left("forward (while timing)") or {
            "status": "ok", "method": self.timer.method, "records": found,
            "own": sorted(self.compiled.names()) if self.cuda else None, "ms": float(probe["times"][0])})

    def time_block(self, request: dict) -> dict:
        self.pending = []
        try:
            block = self.timer.block(request["first"], request["calls"], request["check"])
        except Exception as exc:
            return self._finish(self._run_error(exc, "forward (while timing)"))
        checked = [[k, self._ship(list(outputs)), [list(p) for p in prints]] for k, outputs, prints in block["checked"]]
        return self._finish(self._threads_left("forward (while timing)") or {
            "status": "ok", "times": [float(t) for t in block["times"]], "checked": checked,
            "records": block["records"]})

    def unload(self, request: dict) -> dict:
        """Drop the candidate; a native thread it started that still runs ends this worker
        (`recycle`), so it cannot reach the next candidate (a sibling of the same RL group)."""
        self._drop_candidate()
        left = guard.native_threads() - self.native
        return {"status": "ok", "recycle": bool(left)}

    def _forward(self, inputs: list, seed: int, marked: bool = False) -> list:
        trusted.manual_seed(seed)
        with trusted.no_grad():
            outputs = flatten(self.model(*inputs))
        if marked:
            trusted.marker(0)   # on torch's current stream, after forward returned (`records.split_marker`)
        return outputs

    def _call_watching_streams(self, inputs: list, seed: int) -> tuple[list, list[int]]:
        """Forward once; on CUDA also the outputs that changed after torch's stream was done."""
        outputs = self._forward(inputs, seed)
        if not self.cuda:
            return outputs, []
        stream = torch.cuda.current_stream(self.device)
        stream.synchronize()
        with torch.cuda.stream(stream):
            snapshot = [trusted.clone(t) if type(t) is torch.Tensor and t.is_cuda else None for t in outputs]
        trusted.cuda_synchronize(self.device)
        return outputs, [i for i, s in enumerate(snapshot) if s is not None and not same_bits(s, outputs[i])]

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
        self.pending, self.previous, self.earlier, self.model, self.task, self.timer = [], [], [], None, None, None
        for name in [m for m in sys.modules if m.startswith("dice_candidate_") or m == "dice_task"]:
            del sys.modules[name]
        _restore_global_flags(self.flags)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def _global_flags() -> dict:
    """Process-wide torch settings a candidate may change; restored between candidates."""
    return {"default_dtype": torch.get_default_dtype(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cudnn_deterministic": torch.backends.cudnn.deterministic}


def _restore_global_flags(flags: dict) -> None:
    torch.set_default_dtype(flags["default_dtype"])
    torch.set_float32_matmul_precision(flags["matmul_precision"])
    torch.backends.cuda.matmul.allow_tf32 = flags["tf32_matmul"]
    torch.backends.cudnn.allow_tf32 = flags["tf32_cudnn"]
    torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = flags["cudnn_deterministic"]


