"""Calls to the workers and judges as the stages see them (DESIGN.md §8, §8.4): a candidate
worker's hang, crash or malformed reply becomes a reply with its verdict's status, charged to the
candidate's clock; a judge's failure is the task's (TaskError) unless it came from a candidate's
outputs.
"""
from __future__ import annotations

import time

from .process import WorkerDied, WorkerProcess, WorkerTimeout, describe_exit, log_summary
from .results import TaskError, VerifyResult
from .wire import malformed_reply

JUDGE_TIMEOUT_S = 900.0       # reference forward + comparison of the largest KernelBench tasks
MESSAGE_CHARS = 4000          # of a worker's message kept in a verdict (a candidate controls its text)


class Clock:
    """Seconds left for the candidate; only time spent waiting on its own worker counts."""

    def __init__(self, seconds: float):
        self.left = seconds


def ask(worker: WorkerProcess, request: dict, clock: Clock, doing: str) -> dict:
    """A candidate-worker request; a hang or crash becomes a reply with status timeout/runtime_error,
    a reply that breaks its op's schema (`malformed_reply`) an `invalid` one (the worker is replaced)."""
    start, limit = time.monotonic(), max(clock.left, 0.0)
    try:
        reply = worker.call(request, timeout=limit)
        problem = malformed_reply(request["op"], reply)
        if problem:
            worker.restart()
            return {"status": "invalid", "message": f"the worker's reply to {request['op']!r} {problem}: "
                    "the candidate tampered with the verifier"}
        reply["message"] = reply.get("message", "")[:MESSAGE_CHARS]
    except WorkerTimeout as exc:
        where = f"; it was in {exc.where}" if exc.where else ""
        return {"status": "timeout", "message": f"the candidate did not finish {doing} in the {limit:.0f} s "
                f"left of its time limit (hang, deadlock or very slow kernel); its worker was killed{where}"}
    except WorkerDied as exc:
        tail = f"; last output:\n{log_summary(exc.log_tail)}" if exc.log_tail else ""
        return {"status": "runtime_error", "message": f"the worker process {describe_exit(exc.exitcode)} "
                f"while {doing} (segfault, os._exit or abort in the candidate){tail}"}
    finally:
        clock.left -= time.monotonic() - start
    return reply


def failed(reply: dict, compiled: bool, where: str = "") -> VerifyResult:
    """The verdict of a reply that is not ok; `where` heads its message (a compile error's own stands)."""
    status = reply["status"]
    message = reply["message"] if not where or status == "compile_error" else f"{where}: {reply['message']}"
    return VerifyResult(status, compiled=compiled and status != "compile_error", message=message)


def judge_call(judge: WorkerProcess, request: dict, candidate_outputs: bool = False) -> dict:
    """A request to the task's judge. Failures are the task's (raised) unless they came from handling a
    candidate's outputs (`candidate_outputs`: returned as a runtime_error reply)."""
    try:
        reply = judge.call(request, timeout=JUDGE_TIMEOUT_S)
    except (WorkerTimeout, WorkerDied) as exc:
        if candidate_outputs:
            return {"status": "runtime_error", "message": f"the judge failed while comparing the outputs ({exc})"}
        raise TaskError(f"task {request['task_key'][:12]}: the reference (judge) worker failed ({exc}); the "
                        "task's Model, get_inputs or get_init_inputs crashes or hangs; fix the task source") from None
    if reply["status"] == "task_error":
        raise TaskError(f"task {request['task_key'][:12]}: the reference failed: {reply['message']}; "
                        "fix the task source")
    if reply["status"] != "ok" and not candidate_outputs:
        raise RuntimeError(reply["message"])
    return reply
