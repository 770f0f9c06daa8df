"""Timed blocks of calls, clocked outside the timed process (DESIGN.md §8.3).

A block is `calls` forwards of one model back to back, on call slots: input tensors that the judge
owns (`CallSlots`: allocated there, written there with each block's new inputs, shared with the
candidate's worker through CUDA IPC or, on a CPU, a memory-mapped file), so no process that runs
candidate code ever holds the inputs of a later block or the seed they come from. The same slots
serve the candidate and its eager baseline. Two ways to run a block (`BlockRunner`), the same for
both sides (the parent picks one both can use):
- "graph": one CUDA graph captured over all the slots, one forward per slot, replayed as a whole:
  the block is one launch, its outputs the graph's static outputs, shared with the judge once;
- "eager": the forwards called one after another, each call's outputs copied on the caller's
  stream into output slots the judge owns (work a forward leaves on a stream the caller does not
  wait for is not in them), the same copies on both sides.
Nothing here measures time: the trainer's clock does, from sending the block's request to its
reply, with the candidate's worker stopped (SIGSTOP) except while its block runs and the GPU seen
idle afterwards (`Verifier._timing`). What the worker could change in its own process (this
module's code, its clocks, its replies) changes no time, and outputs are read where they lie, by
the judge, while the worker is stopped.
"""
from __future__ import annotations

import mmap
import os
import tempfile

import numpy
import torch
from torch import nn

from .outputs import flatten, relative_error
from .rules import trusted
from .wire import export_tensor, import_tensor

L2_FLUSH_BYTES = 256 * 2**20    # > L2 of any current GPU (H100 50 MB, H200 60 MB, B200 126 MB)
FAITHFUL = 1e-3                 # a graph replay within this relative error of the eager outputs
BLOCK_MS = 10.0                 # forwards per block: about this much of the reference's time
MAX_CALLS, MIN_CALLS = 256, 3
SLOT_BYTES = 2 * 2**30          # a block's slots (inputs and eager outputs) take at most this


def calls_per_block(ms_per_call: float, call_bytes: int) -> int:
    """Calls per block: about BLOCK_MS of the reference's forwards, MIN_CALLS..MAX_CALLS, fewer
    where their slots would pass SLOT_BYTES (at least one)."""
    calls = max(MIN_CALLS, min(MAX_CALLS, int(BLOCK_MS / max(ms_per_call, 1e-3))))
    return max(1, min(calls, SLOT_BYTES // max(call_bytes, 1)))


class CallSlots:
    """The judge's slots: `calls` sets of input tensors shaped like `template` (non-tensor inputs
    kept as they are), and with `outputs` (eager) one set of output tensors shaped like the
    reference's outputs for each side ("baseline", "candidate"). On a GPU each tensor is its own
    allocation shared by CUDA IPC; on a CPU (tests) all live in one memory-mapped file."""

    def __init__(self, template: list, calls: int, device: torch.device, outputs: list | None = None):
        self.device, self.calls = device, calls
        likes = [x for x in template if isinstance(x, torch.Tensor)] * calls + list(outputs or []) * 2 * calls
        self._file = _SlotFile(likes) if device.type != "cuda" else None
        self.tensors: dict[tuple[str, int], list] = {
            ("inputs", k): [self._new(x) if isinstance(x, torch.Tensor) else x for x in template] for k in range(calls)}
        for side in ("baseline", "candidate") if outputs is not None else ():
            for k in range(calls):
                self.tensors[side, k] = [self._new(t) for t in outputs]

    def _new(self, like: torch.Tensor) -> torch.Tensor:
        if self._file is not None:
            return self._file.take(like)
        return torch.empty(like.shape, dtype=like.dtype, device=self.device)

    def inputs(self, k: int) -> list:
        return self.tensors["inputs", k]

    def outputs(self, side: str, k: int) -> list:
        return self.tensors.get((side, k), [])

    def write(self, k: int, values: list) -> None:
        for slot, value in zip(self.inputs(k), values):
            if isinstance(slot, torch.Tensor):
                slot.copy_(value)

    def shared(self, side: str) -> dict:
        """What the `side` process needs to open its slots (`open_slots`): plain data."""
        def one(x):
            if not isinstance(x, torch.Tensor):
                return ["value", x]
            if self._file is not None:
                return ["file", *self._file.where(x)]
            return ["cuda", export_tensor(x)[0]]
        return {"inputs": [[one(x) for x in self.inputs(k)] for k in range(self.calls)],
                "outputs": [[one(x) for x in self.outputs(side, k)] for k in range(self.calls)]}

    def close(self) -> None:
        self.tensors = {}
        if self._file is not None:
            self._file.close()


def open_slots(shared: dict) -> tuple[list, list]:
    """(inputs per call, output slots per call) from `CallSlots.shared`, in the other process."""
    def one(entry):
        kind, *rest = entry
        if kind == "value":
            return rest[0]
        if kind == "file":
            return _SlotFile.open(*rest)
        return import_tensor(rest[0])
    return ([[one(e) for e in call] for call in shared["inputs"]],
            [[one(e) for e in call] for call in shared["outputs"]])


class BlockRunner:
    """One model's block over its slots (module docstring). `method` is what was asked; `.method`
    what this model can do ("graph" needs a faithful capture)."""

    def __init__(self, model: nn.Module, inputs: list[list], outputs: list[list], device: torch.device, method: str):
        self.model, self.inputs, self.out_slots, self.device = model, inputs, outputs, device
        self.graph, self.static = None, []
        self.method = "graph" if method == "graph" and device.type == "cuda" and self._capture() else "eager"

    def _forward(self, inputs: list) -> list:
        with trusted.no_grad():
            return flatten(self.model(*inputs))

    def _capture(self) -> bool:
        """One graph of a forward per slot; True when each replayed output equals the eager one."""
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(self.inputs[0])      # lazy initialisation outside the capture
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = [self._forward(call) for call in self.inputs]
        except Exception:
            trusted.cuda_synchronize(self.device)
            return False
        if not all(type(t) is torch.Tensor for call in static for t in call):
            return False
        graph.replay()
        eager = [self._forward(call) for call in self.inputs]
        trusted.cuda_synchronize(self.device)
        if not all(_close(e, r) for call_e, call_r in zip(eager, static) for e, r in zip(call_e, call_r)):
            return False
        self.graph, self.static = graph, static
        return True

    def run(self) -> None:
        """The block: the graph's one replay, or each call's forward and its outputs' copies into
        the output slots; returns once the device has finished it."""
        if self.graph is not None:
            self.graph.replay()
        else:
            for call, slots in zip(self.inputs, self.out_slots):
                outputs = self._forward(call)
                if len(outputs) != len(slots):
                    raise ValueError(f"forward returned {len(outputs)} outputs, the reference {len(slots)}")
                for slot, out in zip(slots, outputs):
                    if type(out) is not torch.Tensor or out.shape != slot.shape or out.dtype != slot.dtype:
                        raise ValueError("a timed call's output differs in type, shape or dtype from the "
                                         "reference's")
                    slot.copy_(out)
        if self.device.type == "cuda":
            trusted.cuda_synchronize(self.device)

    def outputs(self) -> list[list]:
        """Each call's outputs after `run`: the graph's static outputs, or the output slots."""
        return self.static if self.graph is not None else self.out_slots

    def one_call(self) -> list:
        """A forward on the first slot (the timed path's kernels, profiled by the caller)."""
        return self._forward(self.inputs[0])


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
        sizes = [-(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN for t in likes]
        fd, self.path = tempfile.mkstemp(prefix="dice-slots-")
        os.ftruncate(fd, max(sum(sizes), 1))
        self.map = mmap.mmap(fd, max(sum(sizes), 1))
        os.close(fd)
        self.offset, self.places = 0, {}

    def take(self, like: torch.Tensor) -> torch.Tensor:
        t = _view(self.map, self.offset, like.dtype, list(like.shape))
        self.places[t.data_ptr()] = (self.path, self.offset, str(like.dtype), list(like.shape))
        self.offset += -(-like.numel() * like.element_size() // self.ALIGN) * self.ALIGN
        return t

    def where(self, t: torch.Tensor) -> list:
        return list(self.places[t.data_ptr()])

    @staticmethod
    def open(path: str, offset: int, dtype: str, shape: list, mapped: dict = {}) -> torch.Tensor:
        if path not in mapped:      # one mapping per file, alive as long as the process
            with open(path, "r+b") as f:
                mapped[path] = mmap.mmap(f.fileno(), 0)
        return _view(mapped[path], offset, getattr(torch, dtype.removeprefix("torch.")), shape)

    def close(self) -> None:
        os.unlink(self.path)


def _view(buffer: mmap.mmap, offset: int, dtype: torch.dtype, shape: list) -> torch.Tensor:
    count = int(numpy.prod(shape)) if shape else 1
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=count * dtype.itemsize, offset=offset) if count else \
        torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).view(shape)
