"""Timing a forward in a worker: inputs that change every call, L2 flushed, two clocks (DESIGN.md §8)."""
from __future__ import annotations

import statistics
import types

import torch
from torch import nn

from .checks import trusted
from .harness import make_inputs, nbytes

L2_FLUSH_BYTES = 256 * 2**20    # > L2 of any current GPU (H100 50 MB, H200 60 MB, B200 126 MB)
TIMING_INPUT_BYTES = 2**30      # input sets for timing (see TimedInputs)
PERTURBATION = 2**-6            # relative noise on float inputs per timed call (bf16 resolves 2^-8)


class TimedInputs:
    """Inputs for timed calls, from a seed no correctness trial uses: up to 4 sets of buffers
    (as TIMING_INPUT_BYTES allow), rotated. Before every call, outside the timed bracket, each
    floating input of the set is rewritten as the seed's value x (1 + PERTURBATION u), u uniform in
    [-1, 1) and new per call, so no timed call repeats the values of another or of a correctness
    trial: a forward that caches outputs keyed on input values cannot beat the clock. One keyed on
    buffer addresses is caught by the trial after timing, on new values written into `buffers`."""

    def __init__(self, task: types.ModuleType, seed: int, device: torch.device):
        self.pristine = make_inputs(task, seed, device)
        count = max(1, min(4, TIMING_INPUT_BYTES // max(nbytes(self.pristine), 1) - 1))
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

