"""The trusted side of timed blocks: their inputs, their clock, the GPU left idle, their outputs
compared (DESIGN.md §8.3). Runs in the trainer, which runs no candidate code.

The candidate's worker is stopped (SIGSTOP) for the whole timing but its own blocks: while the
judge writes a block's inputs into the call slots (`timing.CallSlots`, drawn from the secret timing
seed), while the baseline runs and while the outputs are compared. A block's time is this
process's clock from sending the block's request to its reply's last byte, plus however long the
GPU then stays busy with the worker stopped again (work it left running, on any stream or in any
process, is charged to it; past IDLE_LIMIT_S the verdict is `invalid`), less the pipe's round trip
measured on the judge. So nothing the candidate's process does to its own clocks, timers, replies
or records changes its time; it can only finish its work sooner. Every block's outputs are compared
with the baseline's for a sample of calls drawn after the block (`JudgeHandler.compare_block`), in
the judge, while the worker is stopped, so work skipped on any call is caught where it lies.
"""
from __future__ import annotations

from .calls import Clock, ask, failed, judge_call
from .process import WorkerProcess
from .results import VerifyResult

IDLE_LIMIT_S = 2.0     # the GPU still busy this long after a block, with the worker stopped: invalid
MIN_MS = 1e-4          # a call's time is at least this (a block shorter than the round trip)


class SealedBlocks:
    """`baseline(first, n)` and `candidate(first, n)` for `speedup.paired_rounds`: the block of
    `calls` calls from call `first` on, timed as the module docstring says, as [ms per call]; or a
    verdict that ends the timing."""

    def __init__(self, worker: WorkerProcess, judge: WorkerProcess, task_key: str, calls: int, overhead_s: float,
                 clock: Clock):
        self.worker, self.judge, self.key = worker, judge, task_key
        self.calls, self.overhead_s, self.clock = calls, overhead_s, clock

    def _judge(self, op: str, candidate_outputs: bool = False, **fields) -> dict:
        return judge_call(self.judge, {"op": op, "task_key": self.key, **fields}, candidate_outputs)

    def baseline(self, first: int, n: int) -> list | VerifyResult:
        self._judge("timing_inputs", first=first)
        waited = self._idle()           # nothing of the candidate's still runs beside the baseline
        if isinstance(waited, VerifyResult):
            return waited
        self._judge("baseline_block")
        return self._per_call(self.judge.round_trip_s)

    def candidate(self, first: int, n: int) -> list | VerifyResult:
        self._judge("timing_inputs", first=first)   # again: the baseline may have modified them
        if self.worker.descendants():
            return VerifyResult("invalid", compiled=True, message=(
                "timing: the candidate left processes running; all work must finish inside forward, in the "
                "worker's own process"))
        self.worker.resume()
        try:
            reply = ask(self.worker, {"op": "time_block"}, self.clock, "timing forward")
            seconds = self.worker.round_trip_s
        finally:
            self.worker.pause()
        if reply["status"] != "ok":
            return failed(reply, compiled=True, where="timing")
        waited = self._idle()
        if isinstance(waited, VerifyResult):
            return waited
        judged = self._judge("compare_block", candidate_outputs=True, first=first)
        if judged["status"] != "ok":
            return failed(judged, compiled=True, where="timing")
        if judged["mismatch"]:
            return VerifyResult("incorrect", compiled=True, message=(
                f"timed call {judged['call']} (new inputs, compared after its block): {judged['mismatch']}; forward "
                "must do the same work on every call"))
        return self._per_call(seconds + waited)

    def _idle(self) -> float | VerifyResult:
        """Seconds until the GPU was idle with the candidate's worker stopped, or the verdict."""
        waited = self._judge("gpu_idle", limit_s=IDLE_LIMIT_S)["waited_s"]
        if waited is None:
            return VerifyResult("invalid", compiled=True, message=(
                f"timing: the GPU stayed busy {IDLE_LIMIT_S:g} s with the candidate's worker stopped: work it left "
                "running (a native thread, a helper process, kernels launched after its block)"))
        return waited

    def _per_call(self, seconds: float) -> list[float]:
        return [max((seconds - self.overhead_s) * 1e3 / self.calls, MIN_MS)]
