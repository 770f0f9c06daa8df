"""Timed calls, clocked outside the timed process (DESIGN.md §8.3).

A timed call is one forward on the call slots: input tensors that the judge owns (`Slots`:
allocated there and written there with each call's new inputs, shared with the candidate's worker
through CUDA IPC or, on a CPU, a memory-mapped file), so no process that runs candidate code holds
a call's inputs before that call starts, nor the seed they come from: it cannot compute ahead, nor
batch calls. The same slots serve the candidate and its eager baseline. Two ways to run a call
(`CallRunner`), the same for both sides (the parent picks one both can use):
- "graph": the forward captured once in a CUDA graph on the slots and replayed: its outputs are the
  graph's static outputs, shared with the judge once;
- "eager": the forward called, its outputs copied on the caller's stream into output slots the
  judge owns (work left on a stream the caller does not wait for is not in them), on both sides.
Nothing here measures time: the trainer's clock does, from sending the call's request to its
reply, with the candidate's worker stopped (SIGSTOP) but for its own calls and the GPU seen idle
after each (`sealed`). What the worker could change in its own process (this module's code, its
clocks, its replies, its records) changes no time, and outputs are read where they lie, by the
judge, while the worker is stopped.
"""
from __future__ import annotations

import mmap
import os
import tempfile

import torch
from torch import nn

from .outputs import flatten, relative_error
from .rules import trusted
from .wire import export_tensor, import_tensor

L2_FLUSH_BYTES = 256 * 2**20    # > L2 of any current GPU (H100 50 MB, H200 60 MB, B200 126 MB)
FAITHFUL = 1e-3                 # a graph replay within this relative error of the eager outputs


class Slots:
    """The judge's slots: input tensors shaped like `template` (non-tensor inputs kept as they are)
    and, with `outputs` (eager calls), output tensors shaped like the reference's for each side
    ("baseline", "candidate"). On a GPU each tensor is its own allocation, shared by CUDA IPC; on
    a CPU (tests) all live in one memory-mapped file."""

    SIDES = ("baseline", "candidate")

    def __init__(self, template: list, device: torch.device, outputs: list | None = None):
        likes = [x for x in template if isinstance(x, torch.Tensor)] + list(outputs or []) * len(self.SIDES)
        self._file = _SlotFile(likes) if device.type != "cuda" else None
        self.device = device
        self.inputs = [self._new(x) if isinstance(x, torch.Tensor) else x for x in template]
        self.outputs = {side: [self._new(t) for t in outputs or []] for side in self.SIDES}

    def _new(self, like: torch.Tensor) -> torch.Tensor:
        if self._file is not None:
            return self._file.take(like)
        return torch.empty(like.shape, dtype=like.dtype, device=self.device)

    def write(self, values: list) -> None:
        for slot, value in zip(self.inputs, values):
            if isinstance(slot, torch.Tensor):
                slot.copy_(value)

    def shared(self, side: str) -> dict:
        """What the `side` process needs to open its slots (`open_slots`): plain data."""
        def one(x):
            if not isinstance(x, torch.Tensor):
                return ["value", x]
            if self._file is not None:
                return ["file", *self._file.where(x)]
            return ["cuda", export_tensor(x, copy=False)[0]]
        return {"inputs": [one(x) for x in self.inputs], "outputs": [one(x) for x in self.outputs[side]]}

    def close(self) -> None:
        self.inputs, self.outputs = [], {}
        if self._file is not None:
            self._file.close()


def open_slots(shared: dict) -> tuple[list, list]:
    """(inputs, output slots) from `Slots.shared`, in the other process."""
    def one(entry):
        kind, *rest = entry
        if kind == "value":
            return rest[0]
        if kind == "file":
            return _SlotFile.open(*rest)
        return import_tensor(rest[0])
    return [one(e) for e in shared["inputs"]], [one(e) for e in shared["outputs"]]


class CallRunner:
    """One model's timed call on its slots (module docstring). `method` is what was asked;
    `.method` what this model can do ("graph" needs a faithful capture)."""

    def __init__(self, model: nn.Module, inputs: list, outputs: list, device: torch.device, method: str):
        self.model, self.inputs, self.out_slots, self.device = model, inputs, outputs, device
        self.graph, self.static = None, []
        self.method = "graph" if method == "graph" and device.type == "cuda" and self._capture() else "eager"

    def forward(self) -> list:
        """A forward on the slots, untimed (the timed path's kernels, profiled by the caller)."""
        with trusted.no_grad():
            return flatten(self.model(*self.inputs))

    def _capture(self) -> bool:
        """Capture the forward on the slots; True when a replay gives the eager forward's outputs."""
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.forward()      # lazy initialisation outside the capture
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = self.forward()
        except Exception:
            trusted.cuda_synchronize(self.device)
            return False
        if not all(type(t) is torch.Tensor for t in static):
            return False
        graph.replay()
        replayed = [trusted.clone(t) for t in static]
        eager = self.forward()
        trusted.cuda_synchronize(self.device)
        if len(eager) != len(replayed) or not all(_close(e, r) for e, r in zip(eager, replayed)):
            return False
        self.graph, self.static = graph, static
        return True

    def run(self) -> None:
        """The timed call: the graph's replay, or the forward and its outputs' copies into the
        output slots; returns once the device has finished it."""
        if self.graph is not None:
            self.graph.replay()
        else:
            outputs = self.forward()
            if len(outputs) != len(self.out_slots):
                raise ValueError(f"forward returned {len(outputs)} outputs, the reference {len(self.out_slots)}")
            for slot, out in zip(self.out_slots, outputs):
                if type(out) is not torch.Tensor or out.shape != slot.shape or out.dtype != slot.dtype:
                    raise ValueError("a timed call's output differs in type, shape or dtype from the reference's")
                slot.copy_(out)
        if self.device.type == "cuda":
            trusted.cuda_synchronize(self.device)

    def outputs(self) -> list:
        """The call's outputs after `run`: the graph's static outputs, or the output slots."""
        return self.static if self.graph is not None else self.out_slots


def flush_l2(device: torch.device, buffer: list = []) -> None:
    """Evict the GPU's L2 cache (shared by every process on the GPU) by writing a larger buffer."""
    if device.type != "cuda":
        return
    if not buffer:
        buffer.append(torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device))
    buffer[0].zero_()


def _close(e, r) -> bool:
    return (type(e) is torch.Tensor and e.shape == r.shape and e.dtype == r.dtype
            and (relative_error(e, r) <= FAITHFUL if e.is_floating_point() or e.is_complex() else trusted.equal(e, r)))


class _SlotFile:
    """CPU slots (tests): tensors packed into one temporary file, mapped by both processes."""

    ALIGN = 64

    def __init__(self, likes: list[torch.Tensor]):
        size = max(1, sum(self._size(t) for t in likes))
        fd, self.path = tempfile.mkstemp(prefix="dice-slots-")
        os.ftruncate(fd, size)
        self.map = mmap.mmap(fd, size)
        os.close(fd)
        self.offset, self.places = 0, {}

    def _size(self, t: torch.Tensor) -> int:
        return -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN

    def take(self, like: torch.Tensor) -> torch.Tensor:
        t = _view(self.map, self.offset, like.dtype, list(like.shape))
        self.places[id(t)] = (self.path, self.offset, str(like.dtype), list(like.shape))
        self.offset += self._size(like)
        return t

    def where(self, t: torch.Tensor) -> list:
        return list(self.places[id(t)])

    @staticmethod
    def open(path: str, offset: int, dtype: str, shape: list) -> torch.Tensor:
        with open(path, "r+b") as f:
            buffer = mmap.mmap(f.fileno(), 0)
        return _view(buffer, offset, getattr(torch, dtype.removeprefix("torch.")), shape)

    def close(self) -> None:
        os.unlink(self.path)


def _view(buffer: mmap.mmap, offset: int, dtype: torch.dtype, shape: list) -> torch.Tensor:
    """A tensor over `buffer`'s bytes from `offset` (the tensor keeps the mapping alive)."""
    count = 1
    for n in shape:
        count *= n
    if not count:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=count * dtype.itemsize, offset=offset).view(
        dtype).view(shape)
