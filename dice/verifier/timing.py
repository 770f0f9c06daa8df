"""Timing one model's forward in a worker: the candidate's and the eager reference's alike (DESIGN.md §8).

A `Timer` serves one timing of one model on one task: call k runs on `harness.timed_inputs(k)`
(new values every call, drawn from a seed no correctness trial uses), the L2 cache flushed
before it. Two methods, the same for the candidate and its baseline (the parent picks one both
can use):
- "graph": the forward is captured once in a CUDA graph on static input buffers; call k copies
  its inputs into them and replays the graph between two CUDA events. A replay runs exactly the
  captured kernels and no Python of the candidate at all, so nothing it does can tell timed calls
  from others, skip work on them, or touch the clock. A graph is used only when it is faithful:
  a replay on fresh inputs gives the eager forward's outputs (work on a stream the capture does
  not see, such as the legacy default stream of `<<<...>>>` launches, leaves it unfaithful).
- "eager": a marker kernel, forward, a device-wide synchronize, a second marker; the call's
  time is its span on the GPU's own records between the markers (`call_spans`: CUPTI through the
  profiler, every stream), which candidate Python cannot rewrite, whatever it does to the timing
  loop's frame. On a CPU (tests only) the host clock times the call.
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

from .checks import flatten, relative_error, replaced_functions, trusted, trusted_intact
from .harness import timed_inputs
from .kernels import gpu_activity, marker_name

L2_FLUSH_BYTES = 256 * 2**20    # > L2 of any current GPU (H100 50 MB, H200 60 MB, B200 126 MB)
FAITHFUL = 1e-3                 # a graph replay within this relative error of the eager outputs
COIN = 256
MIN_MS = 1e-4                   # a call that ran nothing on the GPU still gets a positive time


class Timer:
    """See the module docstring. `method` is what was asked; `.method` what this model can do."""

    def __init__(self, model: nn.Module, pristine: list, seed: int, device: torch.device, method: str,
                 inputs: str = "timed"):
        self.model, self.pristine, self.seed, self.device, self.inputs = model, pristine, seed, device, inputs
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(L2_FLUSH_BYTES if self.cuda else 0, dtype=torch.uint8, device=device)
        self.graph, self._harness = None, None
        self.method = "graph" if method == "graph" and self.cuda and self._capture() else "eager"

    def _forward(self, inputs: list) -> list:
        with trusted.no_grad():
            return flatten(self.model(*inputs))

    def _capture(self) -> bool:
        """Capture the forward on static buffers; True when the graph replays faithfully."""
        self.static = [trusted.clone(x) if isinstance(x, torch.Tensor) else x
                       for x in timed_inputs(self.pristine, self.seed, -1, self.inputs)]
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
        fresh = timed_inputs(self.pristine, self.seed, -2, self.inputs)
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

    def profile(self) -> dict:
        """The GPU activity of one timed call (for a graph, of one replay: all replays are alike)."""
        inputs = timed_inputs(self.pristine, self.seed, -3, self.inputs)
        run = (lambda: self._replay(inputs)) if self.graph is not None else (lambda: self._forward(inputs))
        return gpu_activity(run)[1]

    def block(self, first: int, calls: int, check: float, profiled: bool = True) -> dict:
        """Calls first .. first + calls - 1: their times (ms) and the outputs of the checked ones.
        In eager mode on a GPU the block runs under the profiler and each call's time is its span
        on the GPU's own records (`call_spans`); the activity comes back without the harness's
        own kernels (each call's new inputs, L2 flush and two markers, profiled once alone): their
        launches subtracted, their names left out of the kernel durations.
        `profiled=False` (a probe call) times by the host clock instead."""
        if self.graph is None and self.cuda and profiled:
            harness = self._harness_kernels()
            (_, checked), activity = gpu_activity(lambda: self._calls(first, calls, check), frozenset(harness),
                                                  timeline=True)
            times = call_spans(activity.pop("timeline"), marker_name(), calls)
            activity["kernels"] = {k: n - calls * harness.get(k, 0) for k, n in activity["kernels"].items()
                                   if n > calls * harness.get(k, 0)}
            return {"times": times, "checked": checked, "activity": activity}
        times, checked = self._calls(first, calls, check)
        return {"times": times, "checked": checked, "activity": None}

    def _harness_kernels(self) -> dict:
        if self._harness is None:
            def harness_only():
                timed_inputs(self.pristine, self.seed, -4, self.inputs)
                self.flush.zero_()
                trusted.marker(0)
                trusted.marker(0)
            self._harness = gpu_activity(harness_only)[1]["kernels"]
        return self._harness

    def _calls(self, first: int, calls: int, check: float) -> tuple[tuple, list]:
        if not trusted_intact() or replaced_functions():
            raise RuntimeError("the candidate replaced functions the verifier times with")
        # bound to locals now: what candidate code replaces during the loop cannot reach them
        perf, sync, clone, urandom, marker, device = (trusted.perf_counter, trusted.cuda_synchronize, trusted.clone,
                                                      trusted.urandom, trusted.marker, self.device)
        times, checked = (), []          # a tuple: no candidate code can rewrite it in place
        threshold = int(check * COIN)
        for k in range(first, first + calls):
            inputs = timed_inputs(self.pristine, self.seed, k, self.inputs)
            if self.graph is not None:
                self._load(inputs)
                self.flush.zero_()       # not waited for: the GPU is still flushing while the replay is
                outputs, ms = self._timed_replay()   # launched, so the events time the replay, not the launch
            else:
                if self.cuda:
                    self.flush.zero_()
                    sync(device)
                t0 = perf()
                if self.cuda:
                    marker(0)            # the call's span on the GPU starts after this marker ...
                outputs = self._forward(inputs)
                if self.cuda:
                    sync(device)
                    marker(0)            # ... and ends before this one (`call_spans`)
                ms = (perf() - t0) * 1e3
            times += (ms,)
            if urandom(1)[0] < threshold:     # decided after the call, unpredictably
                checked.append((k, [clone(t) if type(t) is torch.Tensor else t for t in outputs]))
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


def call_spans(timeline: list, marker: str, calls: int) -> tuple:
    """Each eager call's time (ms) from the GPU's records of a block: from the first start to the
    last end of the kernels, copies and memsets that started between the call's two markers (its
    work on every stream; the device is synchronized before the second marker). Candidate code
    cannot reach these records, whatever it does to Python state while it runs."""
    markers = [start for start, _, name in timeline if name == marker]
    if len(markers) != 2 * calls:
        raise RuntimeError(f"the timed calls launched {len(markers) - 2 * calls} extra timing markers "
                           "(torch.cuda._sleep); forward must not launch them")
    times = []
    for i in range(calls):
        low, high = markers[2 * i], markers[2 * i + 1]
        inside = [(s, e) for s, e, name in timeline if low <= s < high and name != marker]
        span = (max(e for _, e in inside) - min(s for s, _ in inside)) / 1e6 if inside else 0.0
        times.append(max(span, MIN_MS))
    return tuple(times)
