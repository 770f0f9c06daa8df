"""What runs inside the verifier's worker processes (DESIGN.md §8).

Two roles, each one process (see `dice.verifier_pool`):

- "candidate" (untrusted code): builds one candidate at a time (task module + candidate module),
  runs its forward on seeded inputs and checks the rules that need the live process: which CUDA
  kernels ran (profiler), inputs modified, outputs sharing memory with inputs, outputs still being
  written after torch's current stream finished (work hidden on another stream), background
  threads. It ships its outputs to the judge and, when asked, times itself.
- "judge" (trusted: runs only task code): computes reference outputs per (task, init seed, trial
  seed), caches them (RL verifies 16 candidates per task), compares shipped candidate outputs
  with them, and times the eager baseline. Candidate code never runs in this process, so it cannot
  reach the reference outputs or the comparison.

Tensor transport: CUDA outputs travel as CUDA IPC handles (torch.multiprocessing's pickler; no
copy), CPU outputs as raw bytes. The candidate worker keeps shipped outputs alive until its next
request, as CUDA IPC requires. Whatever a candidate worker sends is decoded strictly: replies to
the parent by `plain_loads` (built-in types only, no class or function is ever looked up, so a
reply cannot run code in the trainer), outputs in the judge by `import_tensor` (only torch's
CUDA-IPC tensor rebuild), so a candidate can neither run code in the trainer nor reach the
judge's reference outputs.

Trust: the harness calls torch through `verifier_checks.trusted` (captured before any candidate
code runs). The candidate worker reports `invalid` (and is recycled) when a candidate replaced one
of `verifier_checks.WATCHED` or any function of the harness itself (`HarnessSnapshot`), or left
threads running. Each worker leads its own process group, so a kill also ends what a candidate
started (compilers, subprocesses). Workers are a boundary against crashes, hangs and reward hacks,
not an OS sandbox: they run as the caller's user (files, signals, new sessions are all within a
candidate's reach; see README's limits), and a candidate in the same interpreter can rewrite the
harness more deeply (e.g. a function's code object) and make its own worker report a false time.
It cannot make the judge accept outputs it did not produce.
"""

from __future__ import annotations

import faulthandler
import gc
import io
import linecache
import multiprocessing.connection
import os
import pickle
import random
import resource
import statistics
import sys
import threading
import traceback
import types
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy
import torch
import torch.multiprocessing  # noqa: F401 - registers the CUDA IPC reductions on ForkingPickler
from torch import nn

from dice.verifier_build import BuildCache, BuildError, is_nvrtc_error, nvrtc_error_message
from dice import verifier_build, verifier_checks
from dice.verifier_checks import (aliased_outputs, compare_outputs, fingerprint, flatten, modified_inputs,
                                  replaced_functions, same_bits, trusted)

L2_FLUSH_BYTES = 256 * 2**20    # > L2 of any current GPU (H100 50 MB, H200 60 MB, B200 126 MB)
TIMING_INPUT_BYTES = 2**30      # input sets for timing (see TimedInputs)
PERTURBATION = 2**-6            # relative noise on float inputs per timed call (bf16 resolves 2^-8)
TASK_IMPORT_SEED = 0            # module-level randomness of a task is the same in every process
WORKER_FILE_BYTES = 2**30       # largest file a worker may write (its log, a build): stops output floods


def serve(conn, role: str, config: dict, log_path: str) -> None:
    """Worker main loop: one request dict in, one reply dict out, until None or EOF."""
    os.setsid()  # its own process group: the parent's kill reaches everything a candidate started
    resource.setrlimit(resource.RLIMIT_FSIZE, (WORKER_FILE_BYTES, WORKER_FILE_BYTES))
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout.reconfigure(line_buffering=True)
    faulthandler.enable()  # a segfault leaves a Python traceback in the log for the parent to quote
    handler = CandidateHandler(config) if role == "candidate" else JudgeHandler(config)
    # bound now: a candidate that later replaces HarnessSnapshot.changed does not reach this call
    harness_changed = HarnessSnapshot(handler).changed if role == "candidate" else list
    send = multiprocessing.connection.Connection.send
    send(conn, handler.info)
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
        send(conn, reply)


class HarnessSnapshot:
    """What a candidate worker's replies and later candidates depend on, captured before any
    candidate code runs: every name in the harness modules, the handler class (and no instance
    attribute shadowing its methods), `trusted`, the pipe and the pickler, and the functions of
    torch's main namespaces (a candidate that patched torch.Tensor.clamp_min would change the next
    candidate's results). `changed()` names those a candidate has since replaced or deleted."""

    def __init__(self, handler: object):
        self.handler = handler   # an instance attribute named like a method would shadow it
        harness = {"dice.verifier_worker": sys.modules[__name__], "dice.verifier_checks": verifier_checks,
                   "dice.verifier_build": verifier_build, "CandidateHandler": CandidateHandler,
                   "verifier_checks.trusted": trusted, "statistics": statistics,
                   "Connection": multiprocessing.connection.Connection, "ForkingPickler": ForkingPickler,
                   "pickle": pickle}
        torch_spaces = {"torch": torch, "torch.Tensor": torch.Tensor, "torch.nn.functional": torch.nn.functional,
                        "torch.nn.Module": nn.Module}
        self.harness, self.torch_spaces = harness, torch_spaces
        self.objects = {(label, name): value for label, space in harness.items() for name, value in vars(space).items()}
        for label, space in torch_spaces.items():   # dir(): methods a class inherits (Tensor's live in C)
            for name in dir(space):
                value = getattr(space, name, None)
                if callable(value):
                    self.objects[label, name] = value

    def changed(self) -> list[str]:
        missing = object()
        changed = []
        for (label, name), value in self.objects.items():
            if label in self.harness:
                now = vars(self.harness[label]).get(name, missing)
            else:
                now = getattr(self.torch_spaces[label], name, missing)
            if now is not value and now != value:   # `!=`: a classmethod is a new bound method each time
                changed.append(f"{label}.{name}")
        methods = vars(type(self.handler))
        changed += [f"the handler's {name}" for name in vars(self.handler) if name in methods]
        changed += [name for name in replaced_functions() if name not in changed]   # verifier_checks.WATCHED
        return changed


# ---------------------------------------------------------------------------------------------
# Shared helpers: modules from source, seeded models and inputs, transport, timing.

def init_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # create the CUDA context now, not inside the first candidate
    return device


def cuda_context_broken(device: torch.device) -> bool:
    """True once a kernel fault (illegal address, device-side assert) has made this process's
    CUDA context unusable: every later CUDA call would fail, so the process must be replaced."""
    if device.type != "cuda":
        return False
    try:
        trusted.cuda_synchronize(device)
        torch.ones(1, device=device).add_(1).item()
        return False
    except Exception:
        return True


def load_module(source: str, filename: str, module_name: str) -> types.ModuleType:
    """Execute `source` as a fresh module; tracebacks then show its lines under `filename`."""
    code = compile(source, filename, "exec")
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(module_name)
    module.__file__ = filename
    sys.modules[module_name] = module  # some libraries (dataclasses, pickling) look modules up here
    exec(code, module.__dict__)
    return module


def load_task(source: str, module_name: str) -> types.ModuleType:
    """The task module, imported under a fixed seed. Some tasks draw their inputs at import time
    (`x = torch.randn(...)` at module level, returned by get_inputs); unseeded, the judge and each
    candidate worker would hold different tensors and compare outputs of different inputs."""
    trusted.manual_seed(TASK_IMPORT_SEED)
    random.seed(TASK_IMPORT_SEED)
    numpy.random.seed(TASK_IMPORT_SEED)
    return load_module(source, "task.py", module_name)


def describe_exception(exc: BaseException, filename: str = "candidate.py") -> str:
    """`Type: message` (first lines) plus the deepest line of `filename` in the traceback."""
    lines = f"{type(exc).__name__}: {exc}".strip().splitlines()
    text = "\n".join(lines[:3])  # CUDA errors append generic debugging hints after these
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    if frames:
        text += f"\n  at {filename} line {frames[-1].lineno}: {frames[-1].line}"
    return text


def to_device(values, device: torch.device) -> list:
    return [v.to(device) if isinstance(v, torch.Tensor) else v for v in values]


def build_model(task: types.ModuleType, cls: type, init_seed: int, device: torch.device) -> nn.Module:
    """cls(*get_init_inputs()) with weights drawn after manual_seed(init_seed), as for the reference."""
    with trusted.no_grad():
        trusted.manual_seed(init_seed)
        init_inputs = to_device(task.get_init_inputs(), device)
        trusted.manual_seed(init_seed)
        return cls(*init_inputs).to(device)


def make_inputs(task: types.ModuleType, seed: int, device: torch.device) -> list:
    trusted.manual_seed(seed)
    return to_device(list(task.get_inputs()), device)


def export_tensor(t: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """(bytes for `import_tensor` in the judge, tensor to keep alive meanwhile)."""
    t = t.detach()
    if not t.is_cuda:
        raw = trusted.clone(t.reshape(-1)).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        return pickle.dumps(("cpu", str(t.dtype), list(t.shape), raw.numpy().tobytes())), t
    try:
        return bytes(ForkingPickler.dumps(t)), t
    except Exception:
        # Memory from another allocator (e.g. CuPy's pool) cannot be IPC-shared by torch: copy it.
        t = trusted.clone(t)
        return bytes(ForkingPickler.dumps(t)), t


class _StrictUnpickler(pickle.Unpickler):
    """Looks up only the globals in `allowed`: unpickling then cannot call anything else."""

    def __init__(self, data: bytes, allowed: frozenset):
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed here")
        return super().find_class(module, name)


_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_CUDA_TENSOR_GLOBALS = frozenset(
    {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), ("torch", "Tensor"), ("torch", "Size"),
     ("torch", "device"), ("torch.storage", "TypedStorage")} | {("torch", str(d)[6:]) for d in _DTYPES.values()})


def plain_loads(data: bytes):
    """Unpickle built-in data (dict, list, tuple, str, bytes, numbers, bool, None) and nothing else."""
    return _StrictUnpickler(data, frozenset()).load()


def import_tensor(data: bytes) -> torch.Tensor:
    """The judge's side of `export_tensor`: a CUDA tensor through torch's IPC rebuild, or a CPU
    tensor from its raw bytes; anything else raises."""
    value = _StrictUnpickler(data, _CUDA_TENSOR_GLOBALS).load()
    if isinstance(value, tuple) and len(value) == 4 and value[0] == "cpu":
        _, dtype, shape, raw = value
        if dtype not in _DTYPES or not isinstance(raw, bytes) or not all(type(n) is int for n in shape):
            raise ValueError("malformed CPU tensor from the candidate worker")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        value = flat.view(_DTYPES[dtype]).reshape(shape)
    if type(value) is not torch.Tensor:
        raise ValueError(f"the candidate worker sent a {type(value).__name__}, not a tensor")
    return value


def _same_layout(a: list, b: list) -> bool:
    """Whether two input lists hold tensors of the same shapes and dtypes at the same places."""
    return len(a) == len(b) and all(
        (x.shape, x.dtype, x.device) == (y.shape, y.dtype, y.device) if isinstance(x, torch.Tensor) else
        not isinstance(y, torch.Tensor) for x, y in zip(a, b))


def _nbytes(values: list) -> int:
    return sum(x.numel() * x.element_size() for x in values if isinstance(x, torch.Tensor))


class TimedInputs:
    """Inputs for timed calls, from a seed no correctness trial uses: up to 4 sets of buffers
    (as TIMING_INPUT_BYTES allow), rotated. Before every call, outside the timed bracket, each
    floating input of the set is rewritten as the seed's value x (1 + PERTURBATION u), u uniform in
    [-1, 1) and new per call, so no timed call repeats the values of another or of a correctness
    trial: a forward that caches outputs keyed on input values cannot beat the clock. One keyed on
    buffer addresses is caught by the trial after timing, on new values written into `buffers`."""

    def __init__(self, task: types.ModuleType, seed: int, device: torch.device):
        self.pristine = make_inputs(task, seed, device)
        count = max(1, min(4, TIMING_INPUT_BYTES // max(_nbytes(self.pristine), 1) - 1))
        self.sets = [[trusted.clone(x) if isinstance(x, torch.Tensor) else x for x in self.pristine]
                     for _ in range(count)]
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.calls = 0

    @property
    def buffers(self) -> list:
        return self.sets[0]

    def next(self) -> list:
        inputs, self.calls = self.sets[self.calls % len(self.sets)], self.calls + 1
        for x, pristine in zip(inputs, self.pristine):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                u = torch.rand(x.shape, generator=self.generator, device=x.device)
                x.copy_(pristine * (1 + PERTURBATION * (2 * u - 1)))
        return inputs


def time_forward(model: nn.Module, inputs: TimedInputs, device: torch.device, warmup: int, trials: int) -> dict:
    """Median forward time over `trials` calls, with two clocks over the same window.

    Per trial: next inputs, flush L2 (write L2_FLUSH_BYTES), synchronize, then [record start event, forward,
    device-wide synchronize (so work on any stream counts), record end event]. `wall_ms` is the
    host perf_counter over that bracket; for honest code it exceeds the event time only by launch
    and sync latency (tens of µs). On CPU both clocks are the host clock."""
    cuda = device.type == "cuda"
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if cuda else None

    def sync():
        if cuda:
            trusted.cuda_synchronize(device)

    events, wall = [], []
    with trusted.no_grad():
        for _ in range(warmup):
            model(*inputs.next())
        sync()
        for _ in range(trials):
            args = inputs.next()
            if cuda:
                flush.zero_()
                start, end = trusted.Event(enable_timing=True), trusted.Event(enable_timing=True)
            sync()
            t0 = trusted.perf_counter()
            if cuda:
                trusted.event_record(start)
            model(*args)
            sync()
            if cuda:
                trusted.event_record(end)
                events.append((start, end))
            wall.append((trusted.perf_counter() - t0) * 1e3)
        sync()
    times = [trusted.event_elapsed_time(s, e) for s, e in events] if cuda else wall
    return {"runtime_ms": statistics.median(times), "wall_ms": statistics.median(wall), "trials": trials}


def launched_kernels(fn, device: torch.device) -> tuple[object, list[str]]:
    """(fn(), names of the CUDA kernels that ran during it, as the profiler reports them)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with trusted.profile(activities=activities) as prof:
        result = fn()
        trusted.cuda_synchronize(device)
    return result, sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


# ---------------------------------------------------------------------------------------------
# The candidate role.

class CandidateHandler:
    """Loads, runs and times one candidate at a time (requests: load, run, time, unload)."""

    def __init__(self, config: dict):
        self.device = init_device(config["device"])
        self.cuda = self.device.type == "cuda"
        self.builds = BuildCache(Path(config["cache_dir"]) / "torch_extensions", self.device)
        self.builds.install()
        self.warmup, self.timing_trials = config["warmup"], config["timing_trials"]
        self.task = self.model = None
        self.timed: TimedInputs | None = None   # the last timing's inputs, for the trial after it
        self.pending: list[torch.Tensor] = []  # shipped to the judge; alive until the next request
        self.loads = 0
        if self.cuda:
            try:
                import cupy  # noqa: F401 - warm import; CuPy candidates then start fast
            except ImportError:
                pass
        # Starts CUPTI once, here, and checks that the profiler sees kernels at all.
        probe = lambda: torch.ones(1, device=self.device).add_(1)  # noqa: E731
        profiler_works = self.cuda and any(launched_kernels(probe, self.device)[1] for _ in range(2))
        self.info = {"device": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
                     "profiler_works": profiler_works}
        self.flags = _global_flags()
        self.threads = set(threading.enumerate())  # the harness's own; any other is a candidate's

    def load(self, request: dict) -> dict:
        if self.task is not None:  # the previous candidate was not unloaded (its worker kept running)
            self._drop_candidate()
        self.task = load_task(request["task_src"], "dice_task")
        self.builds.install()  # again: an earlier candidate may have replaced load_inline
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

    def run(self, request: dict) -> dict:
        """One correctness trial: forward on inputs from `seed` (twice if `repeat`), checks, export.
        With `timed_buffers` the inputs are written into the buffers the last timing used."""
        self.pending = []
        seed = request["seed"]
        inputs = make_inputs(self.task, seed, self.device)
        if request.get("timed_buffers") and self.timed is not None and _same_layout(self.timed.buffers, inputs):
            inputs = [b.copy_(x) if isinstance(x, torch.Tensor) else x for b, x in zip(self.timed.buffers, inputs)]
        originals = [trusted.clone(x) if isinstance(x, torch.Tensor) else None for x in inputs]
        kernels, second = None, None
        try:
            if request["profile"] and self.cuda:
                outputs, not_ready, kernels = self._profiled_call(inputs, seed)
            else:
                outputs, not_ready = self._call(inputs, seed)
            if request["repeat"]:
                second, late = self._call(inputs, seed)
                not_ready = not_ready or late
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
        shipped = [export_tensor(t) for t in outputs]
        shipped_second = [export_tensor(t) for t in second] if second is not None else None
        self.pending = [t for _, t in shipped + (shipped_second or [])]
        return self._finish({
            "status": "ok",
            "outputs": [data for data, _ in shipped],
            "second": [data for data, _ in shipped_second] if shipped_second is not None else None,
            "kernels": kernels,
            "mutated": modified_inputs(originals, inputs),
            "aliased": aliased_outputs(outputs, inputs),
        })

    def time(self, request: dict) -> dict:
        self.pending = []
        try:
            self.timed = TimedInputs(self.task, request["seed"], self.device)
            stats = time_forward(self.model, self.timed, self.device, self.warmup, self.timing_trials)
        except Exception as exc:
            return self._finish(self._run_error(exc, "forward (while timing)"))
        return self._finish({"status": "ok", **stats})

    def unload(self, request: dict) -> dict:
        self._drop_candidate()
        return {"status": "ok"}

    def _call(self, inputs: list, seed: int) -> tuple[list, list[int]]:
        """Forward once; on CUDA also report outputs that changed after torch's stream was done."""
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        trusted.manual_seed(seed)
        with trusted.no_grad():
            outputs = flatten(self.model(*inputs))
        if not self.cuda:
            return outputs, []
        stream.synchronize()
        with torch.cuda.stream(stream):
            snapshot = [trusted.clone(t) if type(t) is torch.Tensor and t.is_cuda else None for t in outputs]
        trusted.cuda_synchronize(self.device)
        late = [i for i, s in enumerate(snapshot) if s is not None and not same_bits(s, outputs[i])]
        return outputs, late

    def _profiled_call(self, inputs: list, seed: int) -> tuple[list, list[int], list[str]]:
        def forward():
            trusted.manual_seed(seed)
            with trusted.no_grad():
                return flatten(self.model(*inputs))
        outputs, kernels = launched_kernels(forward, self.device)
        return outputs, [], kernels

    def _threads_left(self, where: str) -> dict | None:
        """The verdict when candidate code left threads running (they outlive the candidate, so
        the worker is replaced), else None."""
        started = [t.name for t in threading.enumerate() if t not in self.threads and t.is_alive()]
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
        return {"status": "runtime_error", "message": f"{what} raised {describe_exception(exc)}"}

    def _finish(self, reply: dict) -> dict:
        # replaced torch or harness functions are caught for every reply in `serve` (HarnessSnapshot)
        if reply["status"] in ("runtime_error", "compile_error") and cuda_context_broken(self.device):
            reply["recycle"] = True  # e.g. an illegal address: this CUDA context is unusable now
        return reply

    def _drop_candidate(self) -> None:
        self.pending, self.model, self.task, self.timed = [], None, None, None
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


# ---------------------------------------------------------------------------------------------
# The judge role.

class JudgeHandler:
    """Reference outputs, comparisons and baseline timing (requests: reference, compare, baseline)."""

    MODELS_KEPT = 4

    def __init__(self, config: dict):
        self.device = init_device(config["device"])
        self.cache_bytes = int(config["reference_cache_gb"] * 2**30)
        self.warmup, self.timing_trials = config["warmup"], config["timing_trials"]
        self.tasks: dict[str, types.ModuleType] = {}
        self.models: OrderedDict = OrderedDict()      # (task_key, init_seed) -> reference Model
        self.references: OrderedDict = OrderedDict()  # (task_key, init_seed, seed) -> reference record
        self.info = {"device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"}

    def compare(self, request: dict) -> dict:
        try:
            reference = self._reference(request)
        except Exception as exc:
            return self._failed("task_error", describe_exception(exc, "task.py"))
        try:
            got = [import_tensor(data) for data in request["outputs"]]
            second = [import_tensor(data) for data in request["second"]] if request["second"] is not None else None
            expected, atol, rtol = reference["outputs"], request["atol"], request["rtol"]
            reply = {
                "status": "ok",
                "mismatch": compare_outputs(expected, got, atol, rtol),
                "second_mismatch": compare_outputs(expected, second, atol, rtol) if second is not None else None,
                "fingerprints": [fingerprint(t) for t in got],
                **{k: v for k, v in reference.items() if k != "outputs"},
            }
        except Exception as exc:  # e.g. outputs too large to compare in the memory left
            return self._failed("runtime_error", f"comparing the outputs failed: {describe_exception(exc)}")
        del got, second  # releases the CUDA IPC mappings of the candidate's memory
        return reply

    def reference(self, request: dict) -> dict:
        """Compute (and cache) the reference for one seed, so a broken task is blamed on the task."""
        try:
            self._reference(request)
        except Exception as exc:
            return self._failed("task_error", describe_exception(exc, "task.py"))
        return {"status": "ok"}

    def baseline(self, request: dict) -> dict:
        try:
            task = self._task(request["task_key"], request["task_src"])
            model = self._model(task, request["task_key"], request["init_seed"])
            stats = time_forward(model, TimedInputs(task, request["seed"], self.device), self.device, self.warmup,
                                 self.timing_trials)
        except Exception as exc:
            return self._failed("task_error", describe_exception(exc, "task.py"))
        return {"status": "ok", **stats}

    def _failed(self, status: str, message: str) -> dict:
        # a reference that hit a device-side assert leaves this context unusable: without a new
        # judge, every later task would fail the same way
        return {"status": status, "message": message, "recycle": cuda_context_broken(self.device)}

    def _task(self, key: str, source: str) -> types.ModuleType:
        if key not in self.tasks:
            self.tasks[key] = load_task(source, f"dice_task_{key[:16]}")
        return self.tasks[key]

    def _model(self, task: types.ModuleType, task_key: str, init_seed: int) -> nn.Module:
        key = (task_key, init_seed)
        if key not in self.models:
            self.models[key] = build_model(task, task.Model, init_seed, self.device)
            while len(self.models) > self.MODELS_KEPT:
                self.models.popitem(last=False)
        self.models.move_to_end(key)
        return self.models[key]

    def _reference(self, request: dict) -> dict:
        key = (request["task_key"], request["init_seed"], request["seed"])
        if key in self.references:
            self.references.move_to_end(key)
            return self.references[key]
        task = self._task(request["task_key"], request["task_src"])
        model = self._model(task, request["task_key"], request["init_seed"])
        inputs = make_inputs(task, request["seed"], self.device)
        originals = [trusted.clone(x) if isinstance(x, torch.Tensor) else None for x in inputs]
        trusted.manual_seed(request["seed"])
        with trusted.no_grad():
            outputs = flatten(model(*inputs))
        for i, t in enumerate(outputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Model.forward returns a {type(t).__name__} as output {i}; "
                                "only tensors (or tuples of tensors) can be compared")
        reference = {
            "outputs": [t.detach() for t in outputs],
            "reference_fingerprints": [fingerprint(t) for t in outputs],
            "reference_mutated": modified_inputs(originals, inputs),
            "reference_aliased": aliased_outputs(outputs, inputs),
        }
        self.references[key] = reference
        while len(self.references) > 1 and self._cached_bytes() > self.cache_bytes:
            self.references.popitem(last=False)
        return reference

    def _cached_bytes(self) -> int:
        return sum(_nbytes(r["outputs"]) for r in self.references.values())
