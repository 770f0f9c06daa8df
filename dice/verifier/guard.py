"""What candidate Python may not do in its worker, and the checks that it did not (DESIGN.md §8.4).

The candidate runs in the same interpreter as the harness that times it and ships its records.
Python gives code several ways to run inside someone else's code; they are closed here:
- interpreter hooks: an audit hook, installed before any candidate code runs, refuses
  `sys.setprofile`, `sys.settrace` (a profile function runs at every call of the harness, with its
  frames), `sys.addaudithook` (so no candidate hook follows this one), `sys._current_frames` and
  the gc's object walks (`gc.get_objects`, `get_referrers`, `get_referents`: ways to the harness's
  objects that do not pass through the candidate's own frames);
- callbacks the interpreter would run between harness lines: gc callbacks, signal handlers,
  `sys.unraisablehook`, import hooks (`sys.meta_path`, `sys.path_hooks`), torch function and
  dispatch modes (they would run on every torch call of the harness) and the dispatcher's kernels
  of `aten::_addmm_activation` (`epilogues.unfuse_activations`) must be as they were
  (`callbacks_changed`, after every request);
- threads and processes: a Python thread left running is `invalid` (`worker._threads_left`,
  `_thread._count` included, which sees threads started with `_thread.start_new_thread`); a live
  child process at a reply is `invalid`; a native thread still alive when the candidate is
  unloaded ends the worker (`native_threads`), so nothing reaches the next candidate.
- the profiler's switches: torch's profiler controls (`_toggle_collection_dynamic`, the session's
  prepare / enable / disable, kineto steps, the CUPTI monitor) are replaced by functions that
  refuse in every torch module that binds them (the harness calls the originals it captured,
  `rules.trusted`), and the
  audit hook refuses importing a CUPTI binding (`cupti`, torch's `_cupti_monitor`) and opening
  libcupti or looking up its functions through ctypes, so candidate Python cannot change which
  kinds of activity CUPTI records while it is profiled (`records.unrecorded_launches` finds it
  in the records where it still happens).
Every refusal raises `HarnessTampered`: uncaught, it reaches the verdict as `invalid` with the
reason. What native code (a compiled extension calling CUDA, CUPTI or the interpreter) can do is
beyond this (README, limits).
"""
from __future__ import annotations

import _thread
import builtins
import collections
import gc
import math
import multiprocessing.connection
import os
import pickle
import signal
import statistics
import sys
import threading
import time
import types
from multiprocessing.reduction import ForkingPickler

import torch
import torch.utils._device
from torch import nn

from .rules import HarnessTampered, replaced_functions, trusted

REFUSED = frozenset({"sys.setprofile", "sys.settrace", "sys.addaudithook", "sys._current_frames",
                     "gc.get_objects", "gc.get_referrers", "gc.get_referents"})
# audit events whose arguments may name CUPTI: importing a binding, opening libcupti, finding its functions
NAMING = frozenset({"import", "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle"})
# torch's profiler controls, refused in the candidate's worker wherever torch binds them
PROFILER_CONTROLS = ("_prepare_profiler", "_enable_profiler", "_disable_profiler", "_toggle_collection_dynamic",
                     "_kineto_step", "_enable_profiler_legacy", "_disable_profiler_legacy")


def _refuse(event: str, args: tuple) -> None:
    if event in REFUSED:
        raise HarnessTampered(f"the verifier's worker refuses {event} (a way into the harness that times the "
                              "candidate)")
    if event in NAMING and any("cupti" in str(a).lower() for a in args[:2]):
        named = args[0] if event == "import" else args[-1]
        raise HarnessTampered(f"the verifier's worker refuses {event} of {str(named)[:80]} (CUPTI decides what the "
                              "profiler records)")


def _refusing(name: str):
    def refused(*args, **kwargs):
        raise HarnessTampered(f"the verifier's worker refuses torch's profiler control {name} (the harness's "
                              "profiler decides what is recorded)")
    return refused


def install() -> dict:
    """Install the audit hook (it cannot be removed), put refusals in place of torch's profiler
    controls (module docstring) and return the callbacks as they are now."""
    sys.addaudithook(_refuse)
    import torch.autograd.profiler  # noqa: F401  bound there too
    controls = {id(getattr(torch._C._autograd, name)): name for name in PROFILER_CONTROLS
                if hasattr(torch._C._autograd, name)}
    controls.update({id(getattr(torch._C._profiler, name)): name for name in dir(torch._C._profiler)
                     if name.startswith("_cupti")})
    for module in [m for name, m in sys.modules.items() if name.split(".")[0] == "torch" and m is not None]:
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if id(value) in controls:
                setattr(module, name, _refusing(controls[id(value)]))
    return callbacks()


def callbacks() -> dict:
    """The interpreter's and torch's callbacks that would run candidate code inside the harness."""
    handlers = {}
    for number in sorted(signal.valid_signals()):
        try:
            handlers[int(number)] = signal.getsignal(number)
        except (ValueError, OSError):
            pass
    return {"gc callbacks": list(gc.callbacks), "signal handlers": handlers,
            "sys.unraisablehook": sys.unraisablehook, "sys.meta_path": list(sys.meta_path),
            "sys.path_hooks": list(sys.path_hooks), "a profile or trace function": (sys.getprofile(), sys.gettrace()),
            "torch function modes": torch._C._len_torch_function_stack(),
            "torch dispatch modes": torch._C._len_torch_dispatch_stack(),
            "the dispatcher's kernels of aten::_addmm_activation": torch._C._dispatch_dump("aten::_addmm_activation")}


def callbacks_changed(before: dict) -> list[str]:
    now = callbacks()
    return [name for name, value in before.items() if not _same(value, now[name])]


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b or a == b


def native_threads() -> set[int]:
    """The ids of this process's threads (every kind: Python, native, the CUDA driver's)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def live_children() -> list[int]:
    """Child processes of this process that are still running (zombies collected first)."""
    found = []
    for tid in native_threads():
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                found += [int(pid) for pid in f.read().split()]
        except OSError:
            pass
    alive = []
    for pid in found:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z":
            alive.append(pid)
    return alive


# The standard library the harness runs on: a candidate that rewrote one of these functions
# (collections.Counter, builtins.max, statistics.median, _thread._count) would rewrite the harness.
STDLIB = (builtins, collections, gc, math, os, pickle, signal, statistics, threading, _thread, time, types)
# torch's classes whose methods the harness calls (the profiler that records, the events that time)
TORCH_CLASSES = (torch.profiler.profile, torch.autograd.profiler.profile, torch.cuda.Event, torch.cuda.Stream,
                 torch.cuda.CUDAGraph, multiprocessing.connection.Connection, ForkingPickler,
                 torch.utils._device.DeviceContext)
# torch's modules whose functions the harness reaches: `with device:` (the GPU draw of a trial's
# inputs, `harness.draw`) builds torch.utils._device.DeviceContext, looked up by name
TORCH_MODULES = (torch.utils._device,)


class HarnessSnapshot:
    """What a candidate worker's replies and later candidates depend on, captured before any
    candidate code runs: every name in the harness modules and in the methods of every class they
    define (a candidate that replaced `CallRunner.run` would skip its timed calls), the handler (no instance
    attribute shadowing its methods), `trusted`, the standard library and torch classes the
    harness calls (STDLIB, TORCH_CLASSES), the functions of torch's main namespaces (a candidate
    that patched torch.Tensor.clamp_min would change the next candidate's results), and the
    interpreter's callbacks (`callbacks`). `changed()` names what a candidate has since replaced."""

    def __init__(self, handler: object, modules: tuple, hooks: dict):
        self.handler, self.hooks = handler, hooks
        spaces = {module.__name__: module for module in (*modules, *STDLIB, *TORCH_MODULES)}
        for module in modules:
            spaces.update({f"{module.__name__}.{name}": cls for name, cls in vars(module).items()
                           if isinstance(cls, type) and cls.__module__ == module.__name__})
        spaces.update({f"{cls.__module__}.{cls.__qualname__}": cls for cls in TORCH_CLASSES})
        spaces["rules.trusted"] = trusted
        torch_spaces = {"torch": torch, "torch.Tensor": torch.Tensor, "torch.nn.functional": torch.nn.functional,
                        "torch.nn.Module": nn.Module}
        self.spaces, self.torch_spaces = spaces, torch_spaces
        self.objects = {(label, name): value for label, space in spaces.items() for name, value in vars(space).items()}
        for label, space in torch_spaces.items():   # dir(): methods a class inherits (Tensor's live in C)
            for name in dir(space):
                value = getattr(space, name, None)
                if callable(value):
                    self.objects[label, name] = value

    def changed(self) -> list[str]:
        missing = object()
        changed = []
        for (label, name), value in self.objects.items():
            if label in self.spaces:
                now = vars(self.spaces[label]).get(name, missing)
            else:
                now = getattr(self.torch_spaces[label], name, missing)
            if now is not value and now != value:   # `!=`: a classmethod is a new bound method each time
                changed.append(f"{label}.{name}")
        methods = vars(type(self.handler))
        changed += [f"the handler's {name}" for name in vars(self.handler) if name in methods]
        changed += [name for name in replaced_functions() if name not in changed]   # rules.WATCHED
        return changed + callbacks_changed(self.hooks)
