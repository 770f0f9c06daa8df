"""The judge worker: the trusted process that holds reference outputs (DESIGN.md §8).

It runs only task code, never a candidate's: it computes reference outputs per (task, init seed,
trial seed), caches them (RL verifies 16 candidates per task), compares the outputs a candidate
worker shipped with them, and times the eager baseline. So a candidate can reach neither the
reference outputs nor the comparison.
"""
from __future__ import annotations

import types
from collections import OrderedDict

import torch
from torch import nn

from .checks import aliased_outputs, compare_outputs, fingerprint, flatten, modified_inputs, trusted
from .harness import build_model, cuda_context_broken, describe_exception, init_device, load_task, make_inputs, nbytes
from .protocol import import_tensor
from .timing import TimedInputs, time_forward


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
        return sum(nbytes(r["outputs"]) for r in self.references.values())

