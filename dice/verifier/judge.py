"""The judge worker: the trusted process that holds reference outputs (DESIGN.md §8).

It runs only task code, never a candidate's: it computes reference outputs (and the kernels the
reference launches, under the profiler) per (task, init seed, trial seed, trial kind), caches them
(RL verifies 16 candidates per task) and compares the outputs a candidate worker shipped with them.
For a timing it owns the call slots (`timing.Slots`): it draws every timed call's inputs from the
secret timing seed and writes them there while the candidate's worker is stopped, compares the
candidate's outputs with the baseline's where they lie, and tells when the GPU is idle (the
baseline itself runs in a worker of its own, timed as the candidate is: `Verifier._timing`). So a candidate can reach neither the reference outputs nor the comparison nor the baseline,
nor any timed input before its call starts.
"""
from __future__ import annotations

import copy
import time
import types
from collections import OrderedDict

import torch
from torch import nn

from .epilogues import activation_kernels, gemm_operands
from .harness import (DOMINATED_KINDS, build_model, call_draws, cuda_context_broken, describe_exception, init_device,
                      load_task, make_inputs, nbytes, timed_inputs, trial_inputs)
from .kernels import gpu_activity
from .outputs import aliased_outputs, compare_outputs, fingerprint, flatten, modified_inputs, shared_outputs
from .precision import (EXACT, SERIAL, SERIAL_DOMINATED, in_precision, is_exact_float, loosest, math_flags, model_in,
                        own_error, reduction_terms, tolerances, unit)
from .rules import trusted
from .timing import Slots, flush_l2
from .wire import import_tensor


IDLE_MS = 0.5       # a lone marker kernel takes a few us on an idle GPU; a time slice of another context, ms
IDLE_HOST_MS = 1.0  # ... and returns to the host within this (waiting for another context's slice takes longer)


class JudgeHandler:
    """Requests: reference, compare; for a timing: timing_prepare, timing_outputs, timing_inputs,
    compare_call, gpu_idle, ping, timing_close."""

    MODELS_KEPT = 4

    def __init__(self, config: dict):
        self.device = init_device(config["device"])
        self.cuda = self.device.type == "cuda"
        self.cache_bytes = int(config["reference_cache_gb"] * 2**30)
        self.tasks: dict[str, types.ModuleType] = {}
        self.models: OrderedDict = OrderedDict()      # (task_key, init_seed) -> reference Model
        self.references: OrderedDict = OrderedDict()  # (task_key, init_seed, seed, kind, precision) -> reference
        self.models64: OrderedDict = OrderedDict()    # (task_key, init_seed, dtype) -> the reference Model in dtype
        self.task_errors: dict = {}                   # (task_key, init_seed, precision) -> loosest own_error
        self.epilogues: dict = {}                     # (task_key, init_seed) -> `epilogues.activation_kernels`
        self.timed: dict | None = None                # the timing in progress: its slots, inputs, outputs
        self.info = {"device": torch.cuda.get_device_name(self.device) if self.cuda else "cpu"}

    def reference(self, request: dict) -> dict:
        """Compute (and cache) the reference for one trial, so a broken task is blamed on the task."""
        try:
            self._reference(request)
        except Exception as exc:
            return self._failed("task_error", describe_exception(exc, "task.py"))
        return {"status": "ok"}

    def compare(self, request: dict) -> dict:
        try:
            reference = self._reference(request)
        except Exception as exc:
            return self._failed("task_error", describe_exception(exc, "task.py"))
        try:
            got = [import_tensor(data) for data in request["outputs"]]
            second = [import_tensor(data) for data in request["second"]] if request["second"] is not None else None
            changed = {j: import_tensor(data) for j, data in request["inputs"]}
            allowed = self._tolerances(request, reference["outputs"], self._trial_errors(request, reference))
            reply = {"status": "ok", "mismatch": compare_outputs(reference["outputs"], got, per_output=allowed),
                     "second_mismatch": (compare_outputs(reference["outputs"], second, per_output=allowed)
                                         if second is not None else None),
                     "inputs_mismatch": self._inputs_mismatch(request, reference["inputs_after"], changed),
                     "fingerprints": [fingerprint(t) for t in got],
                     **{k: v for k, v in reference.items() if k not in ("outputs", "own_error", "inputs_after")}}
        except Exception as exc:  # e.g. outputs too large to compare in the memory left
            return self._failed("runtime_error", f"comparing the outputs failed: {describe_exception(exc)}")
        del got, second, changed  # releases the CUDA IPC mappings of the candidate's memory
        return reply

    def _trial_errors(self, request: dict, reference: dict) -> list | None:
        """The trial's own errors (`_own_error`), but the task's loosest for float64 outputs: those
        are measured in float32, whose rounding saturates on values far below its unit (a hot
        trial's faded elements), so the task's trials together show the computation's conditioning."""
        errors = reference["own_error"]
        task = self.task_errors.get((request["task_key"], request["init_seed"], request["precision"]))
        if errors is None or task is None or len(task) != len(errors):
            return errors
        return [t if EXACT.get(e.dtype) == torch.float64 else own
                for e, own, t in zip(reference["outputs"], errors, task)]

    def _inputs_mismatch(self, request: dict, after: dict, changed: dict) -> str | None:
        """Why the inputs the reference modifies in place (`after`: their values once it returned) do
        not end as it leaves them in the candidate's call (`changed`: the inputs forward modified),
        compared as outputs are, or None."""
        for j, expected in sorted(after.items()):
            if j not in changed:
                return f"input {j} is unchanged after forward"
            mismatch = compare_outputs([expected], [changed[j]], per_output=self._tolerances(request, [expected], None))
            if mismatch:
                return f"input {j} after forward differs from the reference's ({mismatch})"
        return None

    # -- a timing (DESIGN.md §8.3): the slots, each call's inputs, the comparisons --

    def timing_prepare(self, request: dict) -> dict:
        """Slots for a timing on the secret timing seed (`timing.Slots`) holding a first call's
        inputs; what the candidate's worker and the baseline's need to open them, the reference's
        time per call (this process's clock) and its timed kernels."""
        self.timing_close(request)
        try:
            math_flags(request["precision"])
            task = self._task(request["task_key"], request["task_src"])
            model = self._model(task, request["task_key"], request["init_seed"])
            pristine = make_inputs(task, request["seed"], self.device, request["task_src"])
            draws = call_draws(task, request["task_src"], request["seed"], self.device, pristine)

            def call_inputs(call: int) -> list:
                return timed_inputs(pristine if draws is None else draws(call), request["seed"], call,
                                    request["inputs"])
            template = call_inputs(-1)
            outputs, ms = self._reference_ms(model, template, request["seed"])
            slots = Slots(template, self.device, outputs if request["method"] == "eager" else None)
            slots.write(template)
            self.timed = {"slots": slots, "inputs": call_inputs, "request": request, **slots.outputs}
            activity = None
            if self.cuda:
                _, activity = gpu_activity(lambda: self._forward(model, slots.inputs, request["seed"]))
                activity["epilogues"] = self._epilogues(request, model, template)
        except Exception as exc:
            return self._failed("task_error", describe_exception(exc, "task.py"))
        return {"status": "ok", "activity": activity, "ms": ms,
                "slots": {side: slots.shared(side) for side in Slots.SIDES}}

    def _reference_ms(self, model: nn.Module, inputs: list, seed: int) -> tuple[list, float]:
        """(the reference's outputs on `inputs`, its time per call in ms: the best of three by this
        process's own clock), to size the rounds."""
        outputs, best = self._forward(model, inputs, seed), float("inf")
        for _ in range(3):
            if self.cuda:
                trusted.cuda_synchronize(self.device)
            start = time.perf_counter()
            self._forward(model, inputs, seed)
            if self.cuda:
                trusted.cuda_synchronize(self.device)
            best = min(best, (time.perf_counter() - start) * 1e3)
        return outputs, best

    def timing_outputs(self, request: dict) -> dict:
        """One side's graph outputs (its static outputs), shared once."""
        try:
            self.timed[request["side"]] = [import_tensor(data) for data in request["outputs"]]
        except Exception as exc:
            return self._failed("runtime_error", f"the {request['side']}'s timed outputs could not be opened: "
                                f"{describe_exception(exc)}")
        return {"status": "ok"}

    def timing_inputs(self, request: dict) -> dict:
        """Timed call request["call"]'s inputs into the slots, then the L2 cache flushed; asked
        while the candidate's worker is stopped."""
        try:
            math_flags(self.timed["request"]["precision"])
            self.timed["slots"].write(self.timed["inputs"](request["call"]))
            flush_l2(self.device)
            if self.cuda:
                trusted.cuda_synchronize(self.device)
        except Exception as exc:
            return self._failed("task_error", describe_exception(exc, "task.py"))
        return {"status": "ok"}

    def compare_call(self, request: dict) -> dict:
        """The candidate's outputs of the call just run against the baseline's, where they lie."""
        timed, base = self.timed, self.timed["request"]
        expected = timed["baseline"]
        errors = self.task_errors.get((base["task_key"], base["init_seed"], base["precision"]))
        try:
            mismatch = compare_outputs(expected, timed["candidate"], per_output=self._tolerances(base, expected, errors))
        except Exception as exc:
            return self._failed("runtime_error", f"comparing the outputs failed: {describe_exception(exc)}")
        return {"status": "ok", "mismatch": mismatch}

    def gpu_idle(self, request: dict) -> dict:
        """Seconds until a marker kernel runs at once (`_prompt`), asked with the candidate's worker
        stopped: work it left on the GPU (a native thread's, a kernel launched after its reply, a
        helper process's) delays the marker by time slices. waited_s None: still busy at limit_s."""
        start = probe = time.perf_counter()
        while not self._prompt():     # waited: until the first prompt marker was launched (0 when idle)
            probe = time.perf_counter()
            if probe - start > request["limit_s"]:
                return {"status": "ok", "waited_s": None}
        return {"status": "ok", "waited_s": probe - start}

    def _prompt(self) -> bool:
        """Whether a marker kernel runs within IDLE_MS on the GPU's clock and IDLE_HOST_MS on the host's."""
        if not self.cuda:
            return True
        start, end = trusted.Event(enable_timing=True), trusted.Event(enable_timing=True)
        host = time.perf_counter()
        trusted.event_record(start)
        trusted.marker(0)
        trusted.event_record(end)
        trusted.cuda_synchronize(self.device)
        return (time.perf_counter() - host) * 1e3 < IDLE_HOST_MS and trusted.event_elapsed_time(start, end) < IDLE_MS

    def ping(self, request: dict) -> dict:
        """An empty request: the caller's clock times the pipe's round trip."""
        return {"status": "ok"}

    def timing_close(self, request: dict) -> dict:
        """The timing's slots freed."""
        if self.timed is not None:
            self.timed["slots"].close()
            self.timed = None
            if self.cuda:
                torch.cuda.empty_cache()
        return {"status": "ok"}

    @staticmethod
    def _tolerances(request: dict, outputs: list, errors: list | None) -> list:
        return tolerances(outputs, errors, request["precision"], request["atol"], request["rtol"], request["rel_l2"])

    def _failed(self, status: str, message: str) -> dict:
        # a reference that hit a device-side assert leaves this context unusable: without a new
        # judge, every later task would fail the same way
        return {"status": status, "message": message, "recycle": cuda_context_broken(self.device)}

    def _task(self, key: str, source: str) -> types.ModuleType:
        if key not in self.tasks:
            self.tasks[key] = load_task(source, f"dice_task_{key[:16]}")
        return self.tasks[key]

    def _model(self, task: types.ModuleType, task_key: str, init_seed: int) -> nn.Module:
        """The reference Model, built once per (task, init seed) and run once before any forward
        that counts, so that lazy initialisation kernels never join its profile."""
        key = (task_key, init_seed)
        if key not in self.models:
            model = build_model(task, task.Model, init_seed, self.device)
            self._forward(model, make_inputs(task, init_seed, self.device), init_seed)
            self.models[key] = model
            while len(self.models) > self.MODELS_KEPT:
                self.models.popitem(last=False)
        self.models.move_to_end(key)
        return self.models[key]

    def _forward(self, model: nn.Module, inputs: list, seed: int) -> list:
        trusted.manual_seed(seed)
        with trusted.no_grad():
            outputs = flatten(model(*inputs))
        for i, t in enumerate(outputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Model.forward returns a {type(t).__name__} as output {i}; "
                                "only tensors (or tuples of tensors) can be compared")
        return outputs

    def _reference(self, request: dict) -> dict:
        key = (request["task_key"], request["init_seed"], request["seed"], request["kind"], request["precision"])
        if key in self.references:
            self.references.move_to_end(key)
            return self.references[key]
        math_flags(request["precision"])
        task = self._task(request["task_key"], request["task_src"])
        model = self._model(task, request["task_key"], request["init_seed"])
        inputs = trial_inputs(task, request["seed"], request["kind"], self.device, request["task_src"])
        originals = [trusted.clone(x) if isinstance(x, torch.Tensor) else None for x in inputs]
        if self.cuda:
            epilogues = self._epilogues(request, model, [x if o is None else trusted.clone(o)
                                                         for o, x in zip(originals, inputs)])
            outputs, activity = gpu_activity(lambda: self._forward(model, inputs, request["seed"]))
            activity["epilogues"] = epilogues
        else:
            outputs, activity = self._forward(model, inputs, request["seed"]), None
        mutated = modified_inputs(originals, inputs)
        # does the reference return memory it returned before? (a call on the same, unmodified values)
        again = self._forward(model, [x if o is None else trusted.clone(o) for o, x in zip(originals, inputs)],
                              request["seed"])
        reference = {
            "outputs": [t.detach() for t in outputs],
            "inputs_after": {j: inputs[j].detach() for j in mutated},
            "reference_fingerprints": [fingerprint(t) for t in outputs],
            "reference_mutated": mutated,
            "reference_aliased": aliased_outputs(outputs, inputs),
            "reference_shared": shared_outputs(outputs),
            "reference_reused": sorted({i for i, _ in aliased_outputs(again, outputs)}),
            "reference_activity": activity,
            "own_error": self._own_error(model, originals, inputs, outputs, request),
        }
        del again
        if reference["own_error"] is not None:
            task_key = (request["task_key"], request["init_seed"], request["precision"])
            self.task_errors[task_key] = loosest(self.task_errors.get(task_key), reference["own_error"])
        self.references[key] = reference
        while len(self.references) > 1 and self._cached_bytes() > self.cache_bytes:
            self.references.popitem(last=False)
        return reference

    def _own_error(self, model: nn.Module, originals: list, inputs: list, outputs: list, request: dict) -> list | None:
        """Per output (worst, relative, terms, s) for the strict rule (`precision.tolerances`): the
        reference's own rounding error (`precision.own_error`: a float32 output against the same
        Model in float64, a float64 output from the Model in float32 scaled to float64's roundoff),
        (0, 0) where the Model does not run in the other precision (tensors made inside forward),
        how many input elements each output element summarises (`precision.reduction_terms`) and the
        share s of a serial sum's worst case allowed on this trial's kind (`precision.SERIAL_DOMINATED`
        where one element dominates, else `SERIAL`). None under "dice" or without an output the strict rule holds to its own precision."""
        if request["precision"] != "strict" or not any(is_exact_float(t) for t in outputs):
            return None
        values = [x if o is None else o for o, x in zip(originals, inputs)]
        runs = {}
        for dtype in {_other(t.dtype) for t in outputs if is_exact_float(t)}:
            try:
                runs[dtype] = self._forward(self._model_in(model, request, dtype), in_precision(values, dtype),
                                            request["seed"])
            except Exception:
                runs[dtype] = None
        errors = []
        for i, e in enumerate(outputs):
            other = runs.get(_other(e.dtype)) if is_exact_float(e) else None
            ratio = 1.0 if _other(e.dtype) == torch.float64 else unit(torch.float64) / unit(torch.float32)
            found = own_error(e, other[i] if other is not None and i < len(other) else None, ratio)
            share = SERIAL_DOMINATED if request["kind"] in DOMINATED_KINDS else SERIAL
            errors.append((*found, reduction_terms(values, e), share))
        return errors

    def _model_in(self, model: nn.Module, request: dict, dtype: torch.dtype) -> nn.Module:
        """A copy of the reference Model in `dtype` (`precision.model_in`), kept per task and dtype."""
        key = (request["task_key"], request["init_seed"], dtype)
        if key not in self.models64:
            self.models64[key] = model_in(copy.deepcopy(model), dtype)
            while len(self.models64) > self.MODELS_KEPT:
                self.models64.popitem(last=False)
        return self.models64[key]

    def _epilogues(self, request: dict, model: nn.Module, inputs: list) -> dict:
        """{library GEMM kernel: activations its epilogue computes} for the reference's products
        (`epilogues`), learnt once per task and init seed; {} where they cannot be."""
        key = (request["task_key"], request["init_seed"])
        if key not in self.epilogues:
            try:
                operands = gemm_operands(lambda: self._forward(model, inputs, request["seed"]))
                self.epilogues[key] = activation_kernels(operands, self.device)
            except Exception:
                self.epilogues[key] = {}
        return self.epilogues[key]

    def _cached_bytes(self) -> int:
        return sum(nbytes(r["outputs"]) for r in self.references.values())


def _other(dtype: torch.dtype) -> torch.dtype:
    """The precision a strict output's own error is measured against: float64 for float32 (and
    complex64) outputs, float32 for float64 (and complex128) ones."""
    return torch.float64 if EXACT.get(dtype) == torch.float32 else torch.float32
