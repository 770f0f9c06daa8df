"""The verifier's trust boundary for timing (issue #67, DESIGN.md §8.3): a timed call's time is the
trainer's clock around the worker's request, whatever the worker replies; its inputs are the
judge's, written while the worker is stopped; work left on the GPU is charged; a wrong output is
`incorrect`. Fakes stand for the worker and judge processes here; `test_verifier_attacks.py` and
the GPU tests run real ones."""
from pathlib import Path

import pytest
import torch

from dice.verifier import sealed
from dice.verifier.calls import Clock
from dice.verifier.sealed import SealedCalls
from dice.verifier.timing import CallRunner, Slots, open_slots

FIXTURES = Path(__file__).parent / "fixtures" / "verifier"
RELU_TASK = (FIXTURES / "relu_task.py").read_text()


class FakeProcess:
    """A worker or judge process: `replies[op]` answers a request, taking `seconds[op]` by the
    caller's clock (`round_trip_s`); stops and wakes are logged beside the requests."""

    def __init__(self, replies: dict, seconds: dict, log: list, name: str):
        self.replies, self.seconds, self.log, self.name = replies, seconds, log, name
        self.round_trip_s, self.role, self.stopped = 0.0, name, False
        self.timeouts = []

    def call(self, request: dict, timeout: float) -> dict:
        assert not self.stopped, f"{self.name} asked {request['op']} while stopped"
        self.log.append((self.name, request["op"]))
        self.timeouts.append(timeout)
        self.round_trip_s = self.seconds.get(request["op"], 0.0)
        return dict(self.replies.get(request["op"], {"status": "ok"}))

    def pause(self):
        self.stopped = True
        self.log.append((self.name, "stop"))

    def resume(self):
        self.stopped = False
        self.log.append((self.name, "wake"))

    def descendants(self):
        return []

    def restart(self):
        self.log.append((self.name, "restart"))


def pair(worker_replies=None, waited=0.0, mismatch=None, worker_s=0.004, baseline_s=0.003, clock_s=60.0):
    log = []
    worker = FakeProcess(worker_replies or {}, {"time_call": worker_s}, log, "worker")
    baseline = FakeProcess({}, {"time_call": baseline_s}, log, "baseline")
    judge = FakeProcess({"gpu_idle": {"status": "ok", "waited_s": waited},
                         "compare_call": {"status": "ok", "mismatch": mismatch}}, {}, log, "judge")
    worker.pause()
    baseline.pause()
    return SealedCalls(worker, baseline, judge, "k" * 64, overhead_s=0.001, clock=Clock(clock_s)), log


def test_a_timed_call_is_the_trainers_clock_less_the_round_trip_whatever_the_worker_replies(monkeypatch):
    """The worker's reply may carry any fields (forged times): only the trainer's own clock counts,
    the pipe's round trip taken off, and work the GPU still ran after the reply added on."""
    monkeypatch.setattr(sealed.os, "urandom", lambda n: b"\x00")    # compare every call
    calls, _ = pair({"time_call": {"status": "ok", "times": [1e-9], "ms": 1e-9}}, waited=0.002)
    base, cand = calls.round(0, 2)
    assert base == pytest.approx([4.0, 4.0])            # (3 ms + 2 ms until the GPU was idle - 1 ms round trip)
    assert cand == pytest.approx([5.0, 5.0])            # (4 ms + 2 ms - 1 ms)


def test_the_worker_runs_only_its_own_calls_and_never_holds_inputs_before_them(monkeypatch):
    """Stopped while the judge writes each call's inputs, while the baseline runs and while its outputs
    are compared; woken for its own call alone; the baseline's worker the same way, so both pay the
    same wake-up."""
    monkeypatch.setattr(sealed.os, "urandom", lambda n: b"\x00")
    calls, log = pair()
    calls.round(7, 1)
    assert log[2:] == [("judge", "timing_inputs"), ("baseline", "wake"), ("baseline", "time_call"),
                       ("baseline", "stop"), ("judge", "gpu_idle"), ("judge", "timing_inputs"), ("worker", "wake"),
                       ("worker", "time_call"), ("worker", "stop"), ("judge", "gpu_idle"), ("judge", "compare_call")]


def test_the_baselines_calls_do_not_spend_the_candidates_time_limit(monkeypatch):
    """A candidate with 0.5 s left waits at most that long for its own calls; the baseline's calls
    (the task's reference, however slow) are waited for on a clock of their own."""
    monkeypatch.setattr(sealed.os, "urandom", lambda n: b"\xff")
    calls, _ = pair(clock_s=0.5)
    calls.round(0, 3)
    assert all(t <= 0.5 for t in calls.worker.timeouts)
    assert min(calls.baseline_worker.timeouts) > 60.0


def test_a_busy_gpu_after_the_call_is_invalid_and_a_wrong_output_incorrect(monkeypatch):
    monkeypatch.setattr(sealed.os, "urandom", lambda n: b"\x00")
    busy, _ = pair(waited=None)
    verdict = busy.round(0, 3)
    assert verdict.status == "invalid" and "stayed busy" in verdict.message
    wrong, _ = pair(mismatch="output: 3 of 4 elements differ")
    verdict = wrong.round(0, 3)
    assert verdict.status == "incorrect" and "timed call 0" in verdict.message and "3 of 4" in verdict.message
    early, _ = pair({"time_call": {"status": "done early"}})
    assert early.round(0, 1).status == "invalid"              # a reply outside the schema


def test_a_share_of_calls_is_compared_decided_after_each_call(monkeypatch):
    coins = iter([b"\x00", b"\xff", b"\xff", b"\x10"])           # below 64 of 256: compared
    monkeypatch.setattr(sealed.os, "urandom", lambda n: next(coins))
    calls, log = pair()
    calls.round(0, 4)
    assert [op for who, op in log].count("compare_call") == 2


def test_the_judges_slots_are_what_the_other_process_opens():
    """The judge's slot tensors and what the candidate's side opens from `shared` are one memory
    (a file mapped twice on a CPU, CUDA IPC on a GPU): what the judge writes the runner reads,
    and the eager runner's output copies land in the judge's output slots."""
    template = [torch.randn(4, 8), 3]
    slots = Slots(template, torch.device("cpu"), outputs=[torch.empty(4, 8)])
    inputs, outputs = open_slots(slots.shared("candidate"))
    fresh = [torch.randn(4, 8), 3]
    slots.write(fresh)
    runner = CallRunner(lambda x, k: x.clamp_min(0), inputs, outputs, torch.device("cpu"), "graph")   # no graph on a CPU
    runner.run()
    assert runner.method == "eager" and inputs[1] == 3
    torch.testing.assert_close(slots.outputs["candidate"][0], fresh[0].clamp_min(0), rtol=0, atol=0)
    assert not slots.outputs["baseline"][0].data_ptr() == slots.outputs["candidate"][0].data_ptr()
    slots.close()


def test_an_eager_call_whose_output_is_not_the_references_shape_fails():
    slots = Slots([torch.randn(4, 8)], torch.device("cpu"), outputs=[torch.empty(4, 8)])
    inputs, outputs = open_slots(slots.shared("candidate"))
    with pytest.raises(ValueError, match="shape"):
        CallRunner(lambda x: x[:2], inputs, outputs, torch.device("cpu"), "eager").run()
    slots.close()


@pytest.mark.slow
def test_the_workers_task_module_draws_no_timed_input(cpu_verifier, tmp_path):
    """The task module's get_inputs in the candidate's worker, wrapped at import, sees the trials'
    draws and none of the timed calls': those are the judge's (issue #67, inputs out of reach)."""
    log = tmp_path / "draws"
    spy = ("import sys, torch\nimport torch.nn as nn\n_task = sys.modules['dice_task']\n_real = _task.get_inputs\n"
           f"def _spy():\n    open({str(log)!r}, 'a').write('draw\\n')\n    return _real()\n"
           "_task.get_inputs = _spy\n\n"
           "class ModelNew(nn.Module):\n    def forward(self, x):\n"
           "        f, timed = sys._getframe(1), False\n"
           "        while f is not None:\n"
           "            timed, f = timed or type(f.f_locals.get('self')).__name__ == 'CallRunner', f.f_back\n"
           f"        open({str(log)!r}, 'a').write('timed\\n' if timed else 'trial\\n')\n"
           "        return x.clamp_min(0)\n")
    result = cpu_verifier.verify(RELU_TASK, spy, trials=2, seed=5)
    assert result.correct, result
    lines = log.read_text().split()
    assert "timed" in lines and "draw" in lines
    assert "draw" not in lines[lines.index("timed"):]      # no draw once the timed calls began


@pytest.mark.slow
def test_every_other_worker_is_stopped_while_one_is_timed(tmp_path):
    """While a candidate is timed, every other worker of the pool, and whatever runs below it, is
    stopped: a candidate still loading, or a thread or helper one left, cannot share the GPU with
    another's timed calls (issue #67: no candidate decides another's time)."""
    import time

    from dice.verifier import Verifier
    from dice.verifier.keeper import descendants

    def state(pid):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    good = ("import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n"
            "    def forward(self, x):\n        return x.clamp_min(0)\n")
    with Verifier(workers=2, judges=1, device="cpu", cache_dir=tmp_path) as verifier:
        verifier.map([(RELU_TASK, good)] * 2, timing=False, seed=1)
        timed, other = verifier._workers
        tree = [other._process.pid, *descendants(other._process.pid)]
        with verifier._others_stopped(timed):
            deadline = time.monotonic() + 2
            while any(state(p) != "T" for p in tree) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [state(p) for p in tree] == ["T"] * len(tree)
            assert state(timed._process.pid) != "T"
        time.sleep(0.05)
        assert "T" not in [state(p) for p in tree]
