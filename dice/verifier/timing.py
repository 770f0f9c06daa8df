"""Timing one model's forward in a worker: the candidate's and the eager reference's alike (DESIGN.md §8).

A `Timer` serves one timing of one model on one task: call k runs on `harness.timed_inputs(k)`
(new values every call, drawn from a seed no correctness trial uses, written into the previous
eager call's input tensors as a training loop reuses its buffers, so outputs cached by input
address answer stale), the L2 cache flushed before it. Two methods, the same for the candidate
and its baseline (the parent picks one both can use):
- "graph": the forward is captured once in a CUDA graph on static input buffers; call k copies
  its inputs into them and replays the graph between two CUDA events. A replay runs exactly the
  captured kernels and no Python of the candidate at all, so nothing it does can tell timed calls
  from others, skip work on them, or touch the clock. A graph is used only when it is faithful:
  a replay on fresh inputs gives the eager forward's outputs (work on a stream the capture does
  not see, such as the legacy default stream of `<<<...>>>` launches, leaves it unfaithful).
- "eager": a marker kernel, forward, a device-wide synchronize, a second marker, then a canary
  copy to the host; the call's time is its span on the GPU's own records between the markers
  (`records.call_windows`: CUPTI through the profiler, every stream), and at least the markers'
  window less the block's empty window (EMPTY_WINDOWS pairs of markers with only a synchronize
  between them, first in the block) and a host allowance, so work the recording missed is not
  free; shipped raw and measured by the judge or the trainer, so nothing candidate Python does to
  the worker (the loop's frame, a tally, a clock) changes it. On a CPU (tests only) the host
  clock times the call.
The L2 flush before a replay is left running while the replay is launched, so the replay's events
time the replay, not the host's launch latency.
Every call's outputs may be checked: after the call returns, a coin from os.urandom decides (with
probability `check` per call), so the candidate cannot know in advance which calls are compared
with the reference, and a forward that skips work on some calls is caught. The candidate's
timed kernels are profiled too (once for a graph, every call in eager mode) and must satisfy the
same kernel rule as its correctness trials.
"""
from __future__ import annotations

import torch
from torch import nn

from .harness import rewritten_in_place, timed_inputs
from .kernels import gpu_records
from .outputs import fingerprint, flatten, relative_error
from .records import EMPTY_WINDOWS
from .rules import HarnessTampered, replaced_functions, trusted, trusted_intact

L2_FLUSH_BYTES = 256 * 2**20    # > L2 of any current GPU (H100 50 MB, H200 60 MB, B200 126 MB)
FAITHFUL = 1e-3                 # a graph replay within this relative error of the eager outputs
COIN = 256


class Timer:
    """See the module docstring. `method` is what was asked; `.method` what this model can do."""

    def __init__(self, model: nn.Module, pristine: list, seed: int, device: torch.device, method: str,
                 inputs: str = "timed", draws=None):
        self.model, self.pristine, self.seed, self.device, self.inputs = model, pristine, seed, device, inputs
        self.draws = draws      # call -> that call's own draw (`harness.call_draws`), or None
        self.held: list = []    # the last eager call's inputs, into which the next call's are written
        self.cuda = device.type == "cuda"
        self.flush_bytes = L2_FLUSH_BYTES if self.cuda else 0
        self.flush = torch.empty(self.flush_bytes, dtype=torch.uint8, device=device)
        self.flush_at = self.flush.data_ptr()
        self.canary = torch.ones(1, device=device)
        self.graph = None
        self.method = "graph" if method == "graph" and self.cuda and self._capture() else "eager"

    def _forward(self, inputs: list) -> list:
        with trusted.no_grad():
            return flatten(self.model(*inputs))

    def call_inputs(self, call: int) -> list:
        """Call `call`'s inputs (`harness.timed_inputs`), from its own draw where there is one."""
        return timed_inputs(self.pristine if self.draws is None else self.draws(call), self.seed, call, self.inputs)

    def _capture(self) -> bool:
        """Capture the forward on static buffers; True when the graph replays faithfully."""
        self.static = [trusted.clone(x) if isinstance(x, torch.Tensor) else x
                       for x in self.call_inputs(-1)]
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(self.static)      # lazy initialisation outside the capture
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.static_out = self._forward(self.static)
        except Exception:
            trusted.cuda_synchronize(self.device)
            return False
        if not all(type(t) is torch.Tensor for t in self.static_out):
            return False
        fresh = self.call_inputs(-2)
        self.graph = graph
        replayed = [trusted.clone(t) for t in self._replay(fresh)]
        eager = self._forward(fresh)
        trusted.cuda_synchronize(self.device)
        return len(eager) == len(replayed) and all(
            type(e) is torch.Tensor and e.shape == r.shape and e.dtype == r.dtype
            and (not e.is_floating_point() or relative_error(e, r) <= FAITHFUL)
            and (e.is_floating_point() or trusted.equal(e, r)) for e, r in zip(eager, replayed))

    def _replay(self, inputs: list) -> list:
        self._load(inputs)
        self.graph.replay()
        return self.static_out

    def _load(self, inputs: list) -> None:
        for buffer, x in zip(self.static, inputs):
            if isinstance(buffer, torch.Tensor):
                buffer.copy_(x)

    def profile(self) -> list:
        """The raw GPU records of one timed call (for a graph, of one replay: all replays are alike)."""
        inputs = self.call_inputs(-3)
        run = (lambda: self._replay(inputs)) if self.graph is not None else (lambda: self._forward(inputs))
        return gpu_records(run)[1]

    def block(self, first: int, calls: int, check: float, profiled: bool = True) -> dict:
        """Calls first .. first + calls - 1: their times (ms) and the outputs of the checked ones.
        In eager mode on a GPU the block runs under the profiler and comes back with its raw
        records, from which the judging side takes each call's time and work
        (`records.call_windows`); the host-clock times are then unused. `profiled=False` (a probe
        call) times by the host clock."""
        if self.graph is None and self.cuda and profiled:
            (times, checked), found = gpu_records(lambda: self._calls(first, calls, check, EMPTY_WINDOWS))
            return {"times": times, "checked": checked, "records": found}
        times, checked = self._calls(first, calls, check)
        return {"times": times, "checked": checked, "records": None}

    def _calls(self, first: int, calls: int, check: float, empty: int = 0) -> tuple[tuple, tuple]:
        """(times, checked): checked holds (call, output copies, their fingerprints) of the calls
        the coin picked, fingerprinted at once, so a later call that rewrote a copy in place is
        caught by the judge. Immutable tuples, and the L2 flush buffer checked after every flush
        (a candidate reaching it through a frame could shrink it): what candidate code can reach
        of this loop it cannot change unnoticed."""
        if not trusted_intact() or replaced_functions():
            raise HarnessTampered("the candidate replaced functions the verifier times with")
        # bound to locals now: what candidate code replaces during the loop cannot reach them
        perf, sync, clone, urandom, marker, to_host, device = (
            trusted.perf_counter, trusted.cuda_synchronize, trusted.clone, trusted.urandom, trusted.marker,
            trusted.to_host, self.device)
        flush, flush_at, flush_bytes, canary = self.flush, self.flush_at, self.flush.numel(), self.canary
        times, checked = (), ()
        threshold = int(check * COIN)
        for _ in range(empty):      # the block's empty windows (`records.windows`)
            sync(device)
            marker(0)
            sync(device)
            marker(0)
        for k in range(first, first + calls):
            inputs = self.call_inputs(k)
            if self.graph is None:       # new values in the last call's tensors: a cache by address answers stale
                inputs = self.held = rewritten_in_place(self.held, inputs)
            if self.graph is not None:
                self._load(inputs)
                flush.zero_()            # not waited for: the GPU is still flushing while the replay is
            elif self.cuda:
                flush.zero_()
            if flush.data_ptr() != flush_at or flush.numel() != flush_bytes or flush_bytes != self.flush_bytes:
                raise HarnessTampered("the candidate changed the timer's L2 flush buffer")
            if self.graph is not None:
                outputs, ms = self._timed_replay()   # launched, so the events time the replay, not the launch
            else:
                if self.cuda:
                    sync(device)
                t0 = perf()
                if self.cuda:
                    marker(0)            # the call's span on the GPU starts after this marker ...
                outputs = self._forward(inputs)
                if self.cuda:
                    sync(device)
                    marker(0)            # ... and ends before this one (`records.call_windows`)
                ms = (perf() - t0) * 1e3
                if self.cuda:
                    to_host(canary)      # copies were recorded (`records.canaries_missing`)
            times += (ms,)
            if urandom(1)[0] < threshold:     # decided after the call, unpredictably
                copies = tuple(clone(t) if type(t) is torch.Tensor else t for t in outputs)
                checked += ((k, copies, tuple(fingerprint(t) for t in copies if type(t) is torch.Tensor)),)
        return times, checked

    def _timed_replay(self) -> tuple[list, float]:
        start, end = trusted.Event(enable_timing=True), trusted.Event(enable_timing=True)
        trusted.event_record(start)
        self.graph.replay()
        trusted.event_record(end)
        trusted.cuda_synchronize(self.device)
        return self.static_out, trusted.event_elapsed_time(start, end)


def calls_per_block(ms_per_call: float, target_ms: float = 8.0) -> int:
    """Timed calls per block: about `target_ms` of forwards, between 3 and 100."""
    return max(3, min(100, int(target_ms / max(ms_per_call, 1e-3))))
