"""The trusted side of timed calls: their inputs, their clock, the GPU left idle, their outputs
compared (DESIGN.md §8.3). Runs in the trainer, which runs no candidate code.

The candidate's worker is stopped (SIGSTOP) for the whole timing but its own calls: while the
judge writes a call's inputs into the slots (`timing.Slots`, drawn from the secret timing seed),
while the baseline runs and while outputs are compared. So it never holds a call's inputs before
that call starts: no work ahead, no calls batched. A call's time is this process's clock from
sending the call's request to its reply's last byte, plus however long the GPU then stays busy
with the worker stopped again (work it left running, on any stream or in any process, is charged
to it; past IDLE_LIMIT_S the verdict is `invalid`), less the pipe's round trip (the median of
pings of the judge, `round_trip`). The baseline's calls are timed the same way, in a worker process
of the same kind running the task's Model, stopped and woken as the candidate's is. Nothing the candidate's process
does to its own clocks, timers, replies or records changes its time; it can only finish sooner.
A call's outputs are compared with the baseline's, in the judge, where they lie, while the worker
is stopped, with probability COMPARED drawn after the call from os.urandom: work skipped on a
share f of calls is caught with probability 1 - (1 - COMPARED f)^calls.

`GpuLock` is the pool-wide readers-writer lock: correctness checks hold it shared, timing holds it
exclusive, so no other work of this pool runs on the GPU while a kernel is being timed.
"""
from __future__ import annotations

import os
import statistics
import threading
from contextlib import contextmanager

from .calls import JUDGE_TIMEOUT_S, Clock, ask, failed, judge_call
from .process import WorkerProcess
from .records import activity
from .results import TaskError, VerifyOptions, VerifyResult
from .speedup import Timing, calls_per_round, paired_rounds
from .verdicts import kernel_verdict, unrecorded_problem

IDLE_LIMIT_S = 2.0     # the GPU still busy this long after a call, with the worker stopped: invalid
MIN_MS = 1e-4          # a call's time is at least this (a call shorter than the round trip's jitter)
COMPARED = 0.25        # the share of timed calls whose outputs are compared
PINGS = 15
WARM_CALLS = 2         # untimed calls on each side before a timing's rounds


def sealed_timing(worker: WorkerProcess, baseline: WorkerProcess, judge: WorkerProcess, request: dict, clock: Clock,
                  opts: VerifyOptions, library: frozenset, budget_s: float) -> Timing | VerifyResult:
    """A candidate's timing against its baseline (module docstring), both workers loaded, the GPU
    lock held: the call runners prepared on the judge's slots (graph where both capture faithfully),
    the timed path's kernel rule, then paired rounds; the Timing or the verdict that ended it."""
    key = request["task_key"]
    for method in ("graph", "eager"):
        base = judge_call(judge, {"op": "timing_prepare", **request, "method": method})
        ref = ask(baseline, {"op": "time_prepare", "method": method, "slots": base["slots"]["baseline"]},
                  Clock(JUDGE_TIMEOUT_S), "timing the reference")
        if ref["status"] != "ok":
            raise reference_failed(key, ref)
        prep = ask(worker, {"op": "time_prepare", "method": method, "slots": base["slots"]["candidate"]}, clock,
                   "timing forward")
        if prep["status"] != "ok":
            return failed(prep, compiled=True, where="timing")
        if prep["method"] == ref["method"] == method:
            break
    problem = kernel_verdict(activity(prep["records"]) if prep["records"] is not None else None, prep["own"],
                             base["activity"], opts, library) or (
        prep["records"] is not None and unrecorded_problem(prep["records"], worker.info.get("matched", [])))
    if problem:
        return VerifyResult("invalid", compiled=True, message=f"timed calls: {problem}")
    for side, reply in (("baseline", ref), ("candidate", prep)):
        if reply["outputs"] is not None:
            shared = judge_call(judge, {"op": "timing_outputs", "task_key": key, "side": side,
                                        "outputs": reply["outputs"]}, candidate_outputs=True)
            if shared["status"] != "ok":
                return failed(shared, compiled=True, where="timing")
    calls = SealedCalls(worker, baseline, judge, key, round_trip(judge, key), clock)
    worker.pause()
    baseline.pause()
    warm = calls.round(-WARM_CALLS, WARM_CALLS)      # untimed: one-time costs, and first comparisons
    timed = warm if not isinstance(warm, tuple) else paired_rounds(calls.round, calls_per_round(base["ms"]),
                                                                    budget_s)
    if not isinstance(timed, Timing):
        return timed
    worker.resume()
    done = ask(worker, {"op": "timing_done"}, clock, "timing forward")   # the checks the calls' replies skip
    if done["status"] != "ok":
        return failed(done, compiled=True, where="timing")
    timed.method = method
    return timed


def reference_failed(task_key: str, reply: dict) -> TaskError:
    """The task's error for a reference that failed in the baseline's worker while timed."""
    return TaskError(f"task {task_key[:12]}: the reference failed while timed: {reply['message']}; fix the task source")


def round_trip(judge: WorkerProcess, task_key: str, pings: int = PINGS) -> float:
    """The pipe's round trip to a worker process woken from a stop and back, with an empty request,
    in seconds: the median of `pings` on the judge (a process the candidate cannot slow)."""
    found = []
    for _ in range(pings):
        judge.pause()
        judge.resume()
        judge_call(judge, {"op": "ping", "task_key": task_key})
        found.append(judge.round_trip_s)
    return statistics.median(found)


class SealedCalls:
    """`round(first, n)` for `speedup.paired_rounds`: calls first .. first + n - 1, each timed on
    the baseline's worker then on the candidate's as the module docstring says, as ([baseline ms per
    call], [candidate ms per call]); or a verdict that ends the timing. Both workers are processes of
    the same kind (the harness's candidate role; the baseline's runs the task's Model), stopped but
    for their own calls, so a stop's cost and a woken process's first call cost both the same."""

    def __init__(self, worker: WorkerProcess, baseline: WorkerProcess, judge: WorkerProcess, task_key: str,
                 overhead_s: float, clock: Clock):
        self.worker, self.baseline_worker, self.judge, self.key = worker, baseline, judge, task_key
        self.overhead_s, self.clock = overhead_s, clock

    def _judge(self, op: str, candidate_outputs: bool = False, **fields) -> dict:
        return judge_call(self.judge, {"op": op, "task_key": self.key, **fields}, candidate_outputs)

    def round(self, first: int, n: int) -> tuple[list, list] | VerifyResult:
        if self.worker.descendants():
            return VerifyResult("invalid", compiled=True, message=(
                "timing: the candidate left processes running; all work must finish inside forward, in the "
                "worker's own process"))
        base, cand = [], []
        for call in range(first, first + n):
            for side, times in ((self.baseline, base), (self.candidate, cand)):
                ms = side(call)
                if isinstance(ms, VerifyResult):
                    return ms
                times.append(ms)
        return base, cand

    def baseline(self, call: int) -> float | VerifyResult:
        return self._call(self.baseline_worker, call)

    def candidate(self, call: int) -> float | VerifyResult:
        ms = self._call(self.worker, call)
        if isinstance(ms, VerifyResult) or os.urandom(1)[0] >= 256 * COMPARED:
            return ms
        judged = self._judge("compare_call", candidate_outputs=True)
        if judged["status"] != "ok":
            return failed(judged, compiled=True, where="timing")
        if judged["mismatch"]:
            return VerifyResult("incorrect", compiled=True, message=(
                f"timed call {call} (new inputs, compared after the call): {judged['mismatch']}; forward "
                "must do the same work on every call"))
        return ms

    def _call(self, worker: WorkerProcess, call: int) -> float | VerifyResult:
        """Call `call` on `worker`: its inputs written (the other side may have modified them), the
        worker woken for its request alone, the GPU then seen idle."""
        self._judge("timing_inputs", call=call)
        # the baseline's calls have a clock of their own: a slow reference must not shorten the candidate's limit
        clock = self.clock if worker is self.worker else Clock(JUDGE_TIMEOUT_S)
        worker.resume()
        try:
            reply = ask(worker, {"op": "time_call"}, clock, "timing forward")
            seconds = worker.round_trip_s
        finally:
            worker.pause()
        if reply["status"] != "ok" and worker is self.baseline_worker:   # the reference's own failure: the task's
            raise reference_failed(self.key, reply)
        if reply["status"] != "ok":
            return failed(reply, compiled=True, where="timing")
        waited = self._idle()
        if isinstance(waited, VerifyResult):
            return waited
        return self._ms(seconds + waited)

    def _idle(self) -> float | VerifyResult:
        """Seconds until the GPU was idle with the candidate's worker stopped, or the verdict."""
        waited = self._judge("gpu_idle", limit_s=IDLE_LIMIT_S)["waited_s"]
        if waited is None:
            return VerifyResult("invalid", compiled=True, message=(
                f"timing: the GPU stayed busy {IDLE_LIMIT_S:g} s with the candidate's worker stopped: work it left "
                "running (a native thread, a helper process, kernels launched after its call returned)"))
        return waited

    def _ms(self, seconds: float) -> float:
        return max((seconds - self.overhead_s) * 1e3, MIN_MS)


class GpuLock:
    """Readers-writer lock, writer-preferring: `shared()` for checks, `exclusive()` for timing.

    Writer preference keeps a steady stream of correctness checks from starving timing."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def shared(self):
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
