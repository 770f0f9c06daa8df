"""The judge worker: the trusted process that holds reference outputs (DESIGN.md §8).

It runs only task code, never a candidate's: it computes reference outputs (and the kernels the
reference launches, under the profiler) per (task, init seed, trial seed, trial kind), caches them
(RL verifies 16 candidates per task), compares the outputs a candidate worker shipped with them,
checks the outputs of timed calls, and times the eager baseline in blocks paired with the
candidate's (`timing.Timer`). So a candidate can reach neither the reference outputs nor the
comparison nor the baseline.
"""
from __future__ import annotations

import copy
import time
import types
from collections import OrderedDict

import torch
from torch import nn

from . import records
from .epilogues import activation_kernels, gemm_operands
from .harness import (build_model, call_draws, cuda_context_broken, describe_exception, init_device, load_task,
                      make_inputs, nbytes, timed_inputs, trial_inputs)
from .kernels import gpu_activity, marker_name
from .outputs import aliased_outputs, compare_outputs, fingerprint, flatten, modified_inputs
from .precision import (EXACT, in_precision, is_exact_float, loosest, math_flags, model_in, own_error, reduction_terms,
                        tolerances, unit)
from .rules import trusted
from .timing import Timer
from .wire import import_tensor


IDLE_MS = 0.5     # a lone marker kernel takes a few us on an idle GPU; a time slice of another context, ms


class JudgeHandler:
    """Requests: reference, compare, compare_timed, baseline_prepare, baseline_block."""

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
        self.timer: Timer | None = None               # the baseline of the timing in progress
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

    def compare_timed(self, request: dict) -> dict:
        """A timed call's outputs against the reference on that call's inputs (never cached)."""
        try:
            math_flags(request["precision"])
            task = self._task(request["task_key"], request["task_src"])
            model = self._model(task, request["task_key"], request["init_seed"])
            pristine = make_inputs(task, request["seed"], self.device, request["task_src"])
            draws = call_draws(task, request["task_src"], request["seed"], self.device, pristine)
            base = pristine if draws is None else draws(request["call"])
            expected = self._forward(model, timed_inputs(base, request["seed"], request["call"], request["inputs"]),
                                     request["seed"])
        except Exception as exc:
            return self._failed("task_error", describe_exception(exc, "task.py"))
        try:
            got = [import_tensor(data) for data in request["outputs"]]
            errors = self.task_errors.get((request["task_key"], request["init_seed"], request["precision"]))
            mismatch = compare_outputs(expected, got, per_output=self._tolerances(request, expected, errors))
            if [fingerprint(t) for t in got] != request["fingerprints"]:
                mismatch = ("the copies of its outputs changed after the call was checked (candidate code rewrote "
                            "the harness's copies)")
        except Exception as exc:
            return self._failed("runtime_error", f"comparing the outputs failed: {describe_exception(exc)}")
        del got
        return {"status": "ok", "mismatch": mismatch}

    def baseline_prepare(self, request: dict) -> dict:
        """The eager reference's Timer for the candidate's timing seed; the reference's timed kernels."""
        try:
            math_flags(request["precision"])
            task = self._task(request["task_key"], request["task_src"])
            model = self._model(task, request["task_key"], request["init_seed"])
            pristine = make_inputs(task, request["seed"], self.device, request["task_src"])
            draws = call_draws(task, request["task_src"], request["seed"], self.device, pristine)
            self.timer = Timer(model, pristine, request["seed"], self.device, request["method"], request["inputs"],
                               draws)
            activity = records.activity(self.timer.profile()) if self.cuda else None
            if activity is not None:
                activity["epilogues"] = self._epilogues(request, model, self.timer.call_inputs(-4))
            probe = self.timer.block(-10, 1, 0.0, profiled=False)
        except Exception as exc:
            return self._failed("task_error", describe_exception(exc, "task.py"))
        return {"status": "ok", "method": self.timer.method, "activity": activity, "ms": float(probe["times"][0])}

    def baseline_block(self, request: dict) -> dict:
        try:
            math_flags(request["precision"])
            block = self.timer.block(request["first"], request["calls"], 0.0)   # profiled as the candidate's are
            times = (block["times"] if block["records"] is None else
                     records.call_windows(block["records"], marker_name(), request["calls"], records.EMPTY_WINDOWS)[0])
        except Exception as exc:
            return self._failed("task_error", describe_exception(exc, "task.py"))
        return {"status": "ok", "times": [float(t) for t in times], "busy": not self._gpu_idle()}

    def _gpu_idle(self, tries: int = 50) -> bool:
        """Whether a marker kernel runs at once (within IDLE_MS between CUDA events), asked after a
        baseline block while the candidate's worker is stopped: another context still running
        work (a kernel the candidate left, a helper process) makes it wait for the GPU's time
        slice. Retried for ~0.5 s; always True on a CPU."""
        if not self.cuda:
            return True
        for _ in range(tries):
            start, end = trusted.Event(enable_timing=True), trusted.Event(enable_timing=True)
            trusted.event_record(start)
            trusted.marker(0)
            trusted.event_record(end)
            trusted.cuda_synchronize(self.device)
            if trusted.event_elapsed_time(start, end) < IDLE_MS:
                return True
            time.sleep(0.01)
        return False

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
        """Per output (worst, relative, terms) for the strict rule (`precision.tolerances`): the
        reference's own rounding error (`precision.own_error`: a float32 output against the same
        Model in float64, a float64 output from the Model in float32 scaled to float64's roundoff),
        (0, 0) where the Model does not run in the other precision (tensors made inside forward),
        and how many input elements each output element summarises (`precision.reduction_terms`).
        None under "dice" or without an output the strict rule holds to its own precision."""
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
            errors.append((*found, reduction_terms(values, e)))
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
