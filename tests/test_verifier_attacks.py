"""CPU tests of the verifier against hostile candidates: code meant to run in the trainer, to reach
the judge's reference outputs, to beat the clock with cached results, or to outlive its worker.

Each attack here succeeded against an earlier version of the verifier (a review's reproductions)."""

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dice.metrics import format_summary, summarize
from dice.verifier import TaskError, Verifier, VerifyOptions, VerifyResult
from dice.verifier.results import static_check
from dice.verifier.wire import export_tensor, import_tensor, plain_loads

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "verifier"
RELU_TASK = (FIXTURES / "relu_task.py").read_text()
MEAN_TASK = (FIXTURES / "mean_task.py").read_text()
GOOD = ("import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n"
        "    def forward(self, x):\n        return x.clamp_min(0)\n")
MATMUL_TASK = """import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, a, b):
        return a @ b

def get_inputs():
    return [torch.randn(256, 256), torch.randn(256, 256)]

def get_init_inputs():
    return []
"""


class RunsCode:
    """Unpickling this calls `open(path, "w")`: proof that a loader ran code it was sent."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_loaders_refuse_anything_but_plain_data_and_tensors(tmp_path):
    marker = tmp_path / "ran"
    for load in (plain_loads, import_tensor):
        with pytest.raises(pickle.UnpicklingError):
            load(pickle.dumps(RunsCode(str(marker))))
    with pytest.raises(pickle.UnpicklingError):
        import_tensor(pickle.dumps(torch.ones(3)))          # torch's own pickle goes through torch.load
    assert not marker.exists()
    reply = {"status": "ok", "kernels": ["k"], "aliased": [[0, 1]], "runtime_ms": 1.5, "second": None}
    assert plain_loads(pickle.dumps(reply)) == reply
    for t in (torch.randn(3, 4), torch.arange(6, dtype=torch.int16).reshape(2, 3)[:, 1:], torch.ones(()),
              torch.empty(0, 5), torch.randn(4, dtype=torch.bfloat16), torch.tensor([True, False])):
        data, _ = export_tensor(t)
        back = import_tensor(data)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


@pytest.mark.slow
def test_a_reply_that_would_run_code_in_the_trainer_is_refused(cpu_verifier, tmp_path):
    # reply["mutated"] pickles an object whose unpickling calls open(): the trainer must not run it
    marker = tmp_path / "ran-in-trainer"
    source = GOOD + (f"\nclass RunsCode:\n    def __reduce__(self):\n"
                     f"        return (open, ({str(marker)!r}, 'w'))\n"
                     "import dice.verifier.outputs as c\n"
                     "c.RunsCode = RunsCode\n"
                     "def evil(originals, inputs):\n    return [RunsCode()]\n"
                     # a new code object in the same function object: the harness snapshot cannot see it
                     "c.modified_inputs.__code__ = evil.__code__\n")
    result = cpu_verifier.verify(RELU_TASK, source, timing=False)
    assert result.status == "invalid" and "not plain data" in result.message, result
    assert not marker.exists()
    assert cpu_verifier.verify(RELU_TASK, GOOD, timing=False).correct        # a fresh worker serves


@pytest.mark.parametrize("patch, name", [
    ("import dice.verifier.worker as w\nw.export_tensor = lambda t: (b'', t)", "export_tensor"),
    ("import statistics\nstatistics.median = lambda values: 1e-6", "statistics.median"),
    ("torch.Tensor.clamp_min = lambda self, m: self.abs()", "torch.Tensor.clamp_min"),   # would skew the next
    ("import dice.verifier.worker as w\nw.CandidateHandler.time_call = lambda self, r: {'status': 'ok'}",
     "CandidateHandler.time_call"),
    # the GPU draw of the inputs (`with device:`) builds this class by name: it would see every input
    ("import torch.utils._device as d\nclass Spy(d.DeviceContext):\n    pass\nd.DeviceContext = Spy",
     "torch.utils._device.DeviceContext"),
])
@pytest.mark.slow
def test_replacing_the_harness_is_invalid(cpu_verifier, patch, name):
    result = cpu_verifier.verify(RELU_TASK, GOOD + "\n" + patch + "\n")
    assert result.status == "invalid" and name in result.message, result
    assert cpu_verifier.verify(RELU_TASK, GOOD, timing=False).correct


@pytest.mark.slow
def test_results_cached_on_input_values_do_not_beat_the_clock(cpu_verifier):
    # computes on the first call per distinct input and replays it after: no timed call repeats
    # values, so it must compute every time (an earlier verifier timed repeats: 9,000x)
    memo = ("import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n        self.memo = {}\n\n"
            "    def forward(self, a, b):\n"
            "        key = tuple(a[0, :4].tolist()) + tuple(b[0, :4].tolist())\n"
            "        if key not in self.memo:\n            self.memo[key] = a @ b\n"
            "        return self.memo[key].clone()\n")      # a fresh output: returning the cached one is invalid
    result = cpu_verifier.verify(MATMUL_TASK, memo, seed=3)
    assert result.correct and result.speedup < 3, result


def test_results_cached_on_buffer_addresses_do_not_beat_the_clock(cpu_verifier):
    # honest through the first calls, then replays outputs by input address: every timed call
    # gets new input tensors (and a graph replay runs no Python), so the cache never answers
    by_address = ("import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n"
                  "    def __init__(self):\n        super().__init__()\n        self.memo, self.calls = {}, 0\n\n"
                  "    def forward(self, a, b):\n        self.calls += 1\n"
                  "        if self.calls <= 6:\n            return a @ b\n"
                  "        key = (a.data_ptr(), b.data_ptr())\n"
                  "        if key not in self.memo:\n            self.memo[key] = a @ b\n"
                  "        return self.memo[key]\n")
    result = cpu_verifier.verify(MATMUL_TASK, by_address, seed=4)
    assert not result.correct or result.speedup < 3, result


@pytest.mark.slow
def test_a_timeout_kills_what_the_candidate_started(cpu_verifier, tmp_path):
    pid_file = tmp_path / "child.pid"
    hang = GOOD.replace("        return x.clamp_min(0)\n",
                        "        import subprocess, time\n"
                        "        child = subprocess.Popen(['sleep', '300'])\n"
                        f"        open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                        "        time.sleep(300)\n")
    result = cpu_verifier.verify(RELU_TASK, hang, timing=False, timeout_s=5)
    assert result.status == "timeout"
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the candidate's subprocess outlived its worker"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"          # a killed child not yet reaped by init is a zombie: dead


@pytest.mark.slow
def test_threads_started_at_load_are_caught_and_the_worker_replaced(cpu_verifier):
    source = GOOD.replace("class ModelNew(nn.Module):\n",
                          "import threading, time\n\nclass ModelNew(nn.Module):\n"
                          "    def __init__(self):\n        super().__init__()\n"
                          "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n\n")
    result = cpu_verifier.verify(RELU_TASK, source, timing=False)
    assert result.status == "invalid" and "background threads" in result.message, result
    assert cpu_verifier.verify(RELU_TASK, GOOD, timing=False).correct   # not blamed on the next candidate


def test_a_flood_of_output_reaches_the_trainer_only_as_a_short_tail(cpu_verifier):
    flood = GOOD.replace("        return x.clamp_min(0)\n",
                         "        import os, sys\n        sys.stdout.write(('x' * 1000 + '\\n') * 20000)\n"
                         "        sys.stdout.flush()\n        os._exit(3)\n")
    result = cpu_verifier.verify(RELU_TASK, flood, timing=False)
    assert result.status == "runtime_error" and "exited with code 3" in result.message
    assert len(result.message) < 20_000


def test_sources_the_parser_cannot_take_are_compile_errors():
    deep = "x = " + "-" * 100_000 + "1\n"
    for source in (deep, "class ModelNew:\n    pass\n\x00"):
        result = static_check(source, need_kernel=False)
        assert result is not None and result.status == "compile_error", source[:20]


@pytest.mark.slow
def test_a_reference_that_kills_its_judge_is_a_task_error(tmp_path):
    crash = RELU_TASK.replace("return [torch.randn(256, 1024)]", "import os\n    os._exit(4)")
    assert crash != RELU_TASK
    with Verifier(workers=1, device="cpu", cache_dir=tmp_path) as v:
        reported = []
        results = v.map([(crash, GOOD), (RELU_TASK, GOOD)], timing=False,
                        on_broken_task=lambda i, e: reported.append((i, e)))
        assert results[0] is None and results[1].correct
        assert [i for i, _ in reported] == [0] and isinstance(reported[0][1], TaskError)
    with pytest.raises(ValueError, match="at least one"):
        VerifyOptions(trials=0)


def test_without_timing_fast_p_is_unknown_not_zero():
    results = [("a", 1, VerifyResult("correct", compiled=True)), ("b", 1, VerifyResult("incorrect", compiled=True))]
    untimed = summarize(results, ks=(1,), timed=False)["all"]
    assert untimed.correct == 0.5 and untimed.fast_0 is None and untimed.fast_1 is None
    table = format_summary({"all": untimed})
    assert table.splitlines()[1].split()[5:8] == ["-", "-", "-"]
    assert summarize(results, ks=(1,))["all"].fast_1 == 0.0


FIND_HANDLER = """
import sys
frame = sys._getframe()
while type(frame.f_locals.get("self")).__name__ != "CandidateHandler":
    frame = frame.f_back
handler = frame.f_locals["self"]
"""
GARBAGE = GOOD.replace("return x.clamp_min(0)", "return torch.zeros_like(x)")


def test_an_instance_attribute_over_a_handler_method_is_caught(cpu_verifier):
    # would make every later candidate of this worker run the reference Model
    poisoner = GOOD + FIND_HANDLER + "handler.load = lambda request: {'status': 'ok'}\n"
    result = cpu_verifier.verify(RELU_TASK, poisoner, timing=False)
    assert result.status == "invalid" and "handler's load" in result.message, result
    assert cpu_verifier.verify(RELU_TASK, GARBAGE, timing=False).status == "incorrect"


@pytest.mark.parametrize("forged, text", [
    ("handler.time_prepare = lambda request: {'status': 'ok', 'method': 'graph', 'records': None, 'own': None, "
     "'outputs': [1]}", "wrong types"),
    ("handler.time_call = lambda request: {'status': 'done early'}", "status 'done early'"),
    ("handler.run = lambda request: {'status': 'pwned', 'message': 'x'}", "status 'pwned'"),
])
@pytest.mark.slow
def test_malformed_replies_are_invalid_and_never_crash_the_caller(cpu_verifier, forged, text):
    # the harness snapshot would catch these: switch it off (below the names it checks) to test
    # the parent's own check of what it reads
    candidate = (GOOD + FIND_HANDLER + "from dice.verifier.guard import HarnessSnapshot as snapshot\n"
                 "snapshot.changed.__code__ = (lambda self: []).__code__\n" + forged + "\n")
    results = cpu_verifier.map([(RELU_TASK, candidate), (RELU_TASK, GOOD)])
    assert results[0].status == "invalid" and text in results[0].message, results[0]
    assert results[1].correct


def test_a_log_replaced_by_a_fifo_does_not_hang_the_caller(cpu_verifier):
    fifo = ("import os\nlog = os.readlink('/proc/self/fd/2')\nos.unlink(log)\nos.mkfifo(log)\nos._exit(3)\n")
    result = cpu_verifier.verify(RELU_TASK, GOOD + fifo, timing=False, timeout_s=20)
    assert result.status == "runtime_error" and "exited with code 3" in result.message, result
    assert cpu_verifier.verify(RELU_TASK, GOOD, timing=False).correct   # its replacement starts


@pytest.mark.slow
def test_a_huge_message_is_cut_before_it_reaches_the_caller(cpu_verifier):
    result = cpu_verifier.verify(RELU_TASK, GOOD.replace("return x.clamp_min(0)", "raise RuntimeError('A' * 5_000_000)"),
                             timing=False)
    assert result.status == "runtime_error" and len(result.message) < 10_000


@pytest.mark.slow
def test_outputs_recorded_by_one_candidate_do_not_answer_another(cpu_verifier, tmp_path):
    # a recorder stores outputs by input sample; a lookup computes nothing: with seeds shared by
    # all candidates of a Verifier the lookup was judged correct (33x)
    store = tmp_path / "store"
    key = "__import__('hashlib').sha1(str(x.reshape(-1)[:8].tolist()).encode()).hexdigest()"
    recorder = GOOD.replace("        return x.clamp_min(0)\n",
                            f"        import os, torch\n        os.makedirs({str(store)!r}, exist_ok=True)\n"
                            f"        out = x.clamp_min(0)\n"
                            f"        torch.save(out, os.path.join({str(store)!r}, {key} + '.pt'))\n"
                            "        return out\n")
    lookup = GOOD.replace("        return x.clamp_min(0)\n",
                          f"        import os, torch\n"
                          f"        path = os.path.join({str(store)!r}, {key} + '.pt')\n"
                          "        return torch.load(path) if os.path.exists(path) else torch.zeros_like(x)\n")
    assert cpu_verifier.verify(RELU_TASK, recorder).correct
    result = cpu_verifier.verify(RELU_TASK, lookup)          # with timing: fresh seeds per candidate there
    assert result.status in ("incorrect", "invalid") and "timed call" in result.message, result


@pytest.mark.slow
def test_a_detached_daemon_ends_with_its_candidate(cpu_verifier, tmp_path):
    """setsid + double fork: the daemon is no child of the worker, but the worker is a child
    subreaper, so the daemon is adopted by it and ended when the candidate is unloaded."""
    pid_file = tmp_path / "daemon.pid"
    daemon = GOOD.replace("        return x.clamp_min(0)\n",
                          "        import os, time\n"
                          "        if os.fork() == 0:\n"
                          "            os.setsid()\n"
                          "            if os.fork() == 0:\n"
                          f"                open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                          "                time.sleep(300)\n"
                          "            os._exit(0)\n"
                          "        time.sleep(0.5)\n"
                          "        return x.clamp_min(0)\n")
    cpu_verifier.verify(RELU_TASK, daemon, timing=False, trials=1)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "a detached daemon outlived its candidate"


HANGING_OWNER = '''import os, sys
from dice.verifier import Verifier
task, candidate, marker = open(sys.argv[1]).read(), open(sys.argv[2]).read(), sys.argv[3]
v = Verifier(workers=1, judges=1, device="cpu", cache_dir=os.path.dirname(marker))
v.verify(task, candidate, timing=False, timeout_s=600)
'''


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
@pytest.mark.slow
def test_no_worker_outlives_a_killed_owner_even_while_a_candidate_hangs(tmp_path, signal_name):
    """A script without a __main__ guard owns a Verifier whose candidate spins in Python; the
    script is killed: within 2 s no process of its workers is left (the keepers watch it)."""
    import signal
    marker = tmp_path / "forward.pid"
    spin = GOOD.replace("        return x.clamp_min(0)\n",
                        f"        import os\n        open({str(marker)!r}, 'w').write(str(os.getpid()))\n"
                        "        while True:\n            pass\n")
    (tmp_path / "task.py").write_text(RELU_TASK)
    (tmp_path / "candidate.py").write_text(spin)
    (tmp_path / "owner.py").write_text(HANGING_OWNER)
    owner = subprocess.Popen([sys.executable, str(tmp_path / "owner.py"), str(tmp_path / "task.py"),
                              str(tmp_path / "candidate.py"), str(marker)], cwd=ROOT)
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline and owner.poll() is None:
        time.sleep(0.1)
    assert marker.exists(), "the candidate never ran"
    from dice.verifier.keeper import descendants
    tree = descendants(owner.pid)
    assert int(marker.read_text()) in tree
    os.kill(owner.pid, getattr(signal, signal_name))
    owner.wait(timeout=30)
    deadline = time.monotonic() + 2
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in tree), [p for p in tree if _alive(p)]


# ---------------------------------------------------------------------------------------------
# Outputs as a caller uses them (issue #34, class 1): each attack below was `correct` before.

def _model(forward: str, init: str = "pass") -> str:
    body = "\n".join("        " + line for line in forward.strip().splitlines())
    return ("import torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    def __init__(self):\n"
            f"        super().__init__()\n        {init}\n\n    def forward(self, x):\n{body}\n")


ROWS_TASK = RELU_TASK.replace("return torch.relu(x)", "return x.mean(0, keepdim=True).relu().repeat(x.shape[0], 1)")
TRANSPOSE_TASK = RELU_TASK.replace("return torch.relu(x)", "return torch.relu(x).t()")
OUTPUT_CASES = {
    # the same buffer on every call: the next call overwrites what the caller holds
    "persistent output buffer": (RELU_TASK, _model(
        "if self.out is None:\n    self.out = torch.empty_like(x)\ntorch.clamp_min(x, 0, out=self.out)\nreturn self.out",
        init="self.out = None"), "invalid", "memory of an output an earlier call returned"),
    # two buffers in turn: each call's output still overwrites the one before last
    "double-buffered output": (RELU_TASK, _model(
        "if not self.bufs:\n    self.bufs = [torch.empty_like(x), torch.empty_like(x)]\n"
        "self.calls += 1\nout = self.bufs[self.calls % 2]\ntorch.clamp_min(x, 0, out=out)\nreturn out",
        init="self.bufs, self.calls = [], 0"), "invalid", "memory of an output an earlier call returned"),
    # one computed row, expanded with stride 0 (the rows of this task's output are all equal)
    "stride-0 expand of one row": (ROWS_TASK, _model(
        "return x.mean(0, keepdim=True).relu().expand(x.shape[0], -1)"), "incorrect", "strides [0, 1]"),
    # outputs memoised by input address: a training loop that reuses its buffers gets stale values
    "outputs memoised by input address": (RELU_TASK, _model(
        "key = x.data_ptr()\nif key not in self.memo:\n    self.memo[key] = x.clamp_min(0)\nreturn self.memo[key].clone()",
        init="self.memo = {}"), "incorrect", "trial 1"),
}
OUTPUT_CONTROLS = {   # honest: they must stay correct
    "a persistent workspace recomputed every call": (RELU_TASK, _model(
        "if self.work is None:\n    self.work = torch.empty_like(x)\ntorch.clamp_min(x, 0, out=self.work)\n"
        "return self.work.clone()", init="self.work = None")),
    "the reference's own (transposed) strides": (TRANSPOSE_TASK, _model("return x.clamp_min(0).t()")),
    "contiguous where the reference is transposed": (TRANSPOSE_TASK, _model("return x.clamp_min(0).t().contiguous()")),
    "a repeat of the row": (ROWS_TASK, _model("return x.mean(0, keepdim=True).relu().repeat(x.shape[0], 1)")),
    # the reference returns a view of its input, so may the candidate (its memory is the caller's input)
    "a view of the input, as the reference's": (RELU_TASK.replace("return torch.relu(x)", "return x.view(-1)"),
                                                _model("return x.view(-1)")),
}


def test_forward_that_skips_work_on_calls_in_quick_succession_is_not_correct(cpu_verifier):
    # honest when called after a pause (every trial, the timing's first calls), zeros when called
    # within 2 ms of its last return, as a caller's loop calls it
    quick = _model("import time\nif time.perf_counter() - self.last < 0.002:\n    out = torch.zeros_like(x)\n"
                   "else:\n    out = x.clamp_min(0)\nself.last = time.perf_counter()\nreturn out",
                   init="self.last = 0.0")
    result = cpu_verifier.verify(RELU_TASK, quick, timing=False, seed=5)
    assert result.status == "incorrect" and "second call" in result.message, result


@pytest.mark.slow
def test_outputs_a_caller_could_not_use_are_not_correct(cpu_verifier):
    cases = list(OUTPUT_CASES.values()) + [(task, src, "correct", "") for task, src in OUTPUT_CONTROLS.values()]
    results = cpu_verifier.map([(task, src) for task, src, _, _ in cases], timing=False, seed=11)
    for name, (_, _, status, text), result in zip([*OUTPUT_CASES, *OUTPUT_CONTROLS], cases, results):
        assert result.status == status and text in result.message, (name, result)


# ---------------------------------------------------------------------------------------------
# Precision downgrades (issue #34, class 2): TF32 or fp16 GEMMs in an fp32 task, CPU stand-ins.

TF32 = ("def tf32(t):   # fp32 rounded to TF32's 10 mantissa bits, as tensor cores read it\n"
        "    return ((t.contiguous().view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)\n")
GEMMS = {   # name: (forward of ModelNew(a, b), strict verdict, dice verdict)
    "TF32 GEMM": ("return tf32(a) @ tf32(b)", "incorrect", "correct"),
    # (under dice too: the hot trial's faded inputs fall below fp16's range)
    "fp16 GEMM": ("return (a.half() @ b.half()).float()", "incorrect", "incorrect"),
    "fp32 GEMM summed in float64 (another order)": ("return (a.double() @ b.double()).float()", "correct", "correct"),
}
GEMM_TASK = MATMUL_TASK.replace("[torch.randn(256, 256), torch.randn(256, 256)]", "[torch.rand(256, 64), torch.rand(64, 256)]")
ROUNDED_TASK = RELU_TASK.replace("return torch.relu(x)", "return (x + 4096.0) - 4096.0")   # fp32 rounds x to ~5e-4


def _gemm(forward: str) -> str:
    return (f"import torch\nimport torch.nn as nn\n\n{TF32}\n\nclass ModelNew(nn.Module):\n"
            f"    def forward(self, a, b):\n        {forward}\n")


@pytest.mark.slow
def test_an_fp32_task_computed_in_lower_precision_is_incorrect_under_the_strict_precision(cpu_verifier):
    pairs = [(GEMM_TASK, _gemm(forward)) for forward, _, _ in GEMMS.values()]   # errors ~1e-3 of outputs ~16
    exact = _model("return x.clone()")   # the exact values; the reference's own fp32 rounding is ~5e-4
    for precision, column in (("strict", 1), ("dice", 2)):
        results = cpu_verifier.map(pairs + [(ROUNDED_TASK, exact)], timing=False, precision=precision, seed=5)
        for (name, case), result in zip(GEMMS.items(), results):
            assert result.status == case[column], (precision, name, result)
        assert results[-1].correct, results[-1]     # within 8x the reference's own error
    assert "incorrect" == cpu_verifier.verify(ROUNDED_TASK, exact, timing=False, atol=1e-4, rel_l2=1e-4, seed=5).status


# ---------------------------------------------------------------------------------------------
# Trials whose structure a candidate cannot count on (issue #34, class 4).

FP16_MEAN_TASK = MEAN_TASK.replace("torch.rand(4096)", "torch.rand(1 << 20).half()")
INT_TASK = RELU_TASK.replace("def get_inputs():\n    return [torch.randn(256, 1024)]",
                             "X = torch.randint(0, 100, (256, 1024))\n\n\ndef get_inputs():\n    return [X]").replace(
    "return torch.relu(x)", "return (x * 3 - 7).float()")
TRIAL_CASES = {
    # fp16: the hot trial's fade used to stop at fp16's smallest normal, so the hot element decided little;
    # since issue #46 the spiked trial's heavy element (`harness.with_heavy`) decides it, before the hot one
    "fp16 mean from the first 1/8": (FP16_MEAN_TASK, _model("return x[: x.numel() // 8].float().mean().half()"),
                                     "incorrect", "(spiked"),
    # integers drawn once at import were the same in every trial: one recorded output answered them all
    "replays one output of integer inputs drawn at import": (INT_TASK, _model(
        "if self.out is None:\n    self.out = (x * 3 - 7).float()\nreturn self.out.clone()", init="self.out = None"),
        "incorrect", "trial 1"),   # recorded at the warm-up call, whose integers lie elsewhere
    "full fp16 mean": (FP16_MEAN_TASK, _model("return x.float().mean().half()"), "correct", ""),
    "integer inputs computed every call": (INT_TASK, _model("return (x * 3 - 7).float()"), "correct", ""),
}


@pytest.mark.slow
def test_structured_trials_reach_fp16_and_integer_inputs(cpu_verifier):
    results = cpu_verifier.map([(task, src) for task, src, _, _ in TRIAL_CASES.values()], timing=False, seed=13)
    for (name, (_, _, status, text)), result in zip(TRIAL_CASES.items(), results):
        assert result.status in status.split("|") and text in result.message, (name, result)


# ---------------------------------------------------------------------------------------------
# A harness candidate Python cannot reach (issue #34, class 5).

FIND_RUNNER = ("import sys\nf = sys._getframe()\nwhile f is not None and type(f.f_locals.get('self')).__name__ != "
               "'CallRunner':\n    f = f.f_back\n")
HARNESS_CASES = {   # name: (candidate, verdict, text), verified without timing
    # a refused hook is harness tampering: `invalid` with the reason (runtime_error before issue #46)
    "an interpreter profile hook": (_model("import sys\nsys.setprofile(lambda *a: None)\nreturn x.clamp_min(0)"),
                                    "invalid", "refuses sys.setprofile"),
    "a walk of the gc's objects": (_model("import gc\ngc.get_objects()\nreturn x.clamp_min(0)"),
                                   "invalid", "refuses gc.get_objects"),
    # refused silently (as Python does when a hook refuses one): were it added, it would shift the output
    "an audit hook of its own": (_model("import sys\nif not self.seen:\n    sys.addaudithook(lambda *a: self.seen.append(1))\n"
                                        "    sys.addaudithook(lambda *a: None)\nreturn x.clamp_min(0) + len(self.seen)",
                                        init="self.seen = []"), "correct", ""),
    "collections.Counter replaced": (_model("import collections\ncollections.Counter = dict\nreturn x.clamp_min(0)"),
                                     "invalid", "collections.Counter"),
    "a builtin replaced": (_model("import builtins\nbuiltins.max = min\nreturn x.clamp_min(0)"), "invalid", "builtins.max"),
    "a gc callback": (_model("import gc\ngc.callbacks.append(lambda *a: None)\nreturn x.clamp_min(0)"),
                      "invalid", "gc callbacks"),
    "a signal handler": (_model("import signal\nsignal.signal(signal.SIGALRM, lambda *a: None)\nreturn x.clamp_min(0)"),
                         "invalid", "signal handlers"),
    "a torch function mode left on": (_model(
        "from torch.overrides import TorchFunctionMode\nTorchFunctionMode().__enter__()\nreturn x.clamp_min(0)"),
        "invalid", "torch function modes"),
    "a _thread thread left running": (_model(
        "import _thread, time\n_thread.start_new_thread(time.sleep, (30,))\nreturn x.clamp_min(0)"),
        "invalid", "started with _thread"),
    "a helper process left running": (_model(
        "import subprocess\nself.p = subprocess.Popen(['sleep', '30'])\nreturn x.clamp_min(0)"),
        "invalid", "left processes running"),
}
TIMED_HARNESS_CASES = {   # verified with timing: none may be correct
    "the call runner's run replaced": _model(
        "import dice.verifier.timing as t\nt.CallRunner.run = lambda self: None\nreturn x.clamp_min(0)"),
    # found through the frames in a timed call: every later call skipped, on this runner only
    "a runner instance's run shadowed": _model(
        FIND_RUNNER + "if f is not None:\n    f.f_locals['self'].run = lambda: None\nreturn x.clamp_min(0)"),
    # skips work in timed calls (a CallRunner on the stack), honest elsewhere
    "zeros in timed calls": _model(FIND_RUNNER + "return x.clamp_min(0) if f is None else torch.zeros_like(x)"),
    # answers its call at once and computes afterwards, in a thread: the worker is stopped by then
    "replies before its block's work": _model(
        FIND_RUNNER + "if f is None:\n    return x.clamp_min(0)\nimport threading, time\ny = torch.zeros_like(x)\n"
        "threading.Thread(target=lambda: (time.sleep(0.05), y.copy_(x.clamp_min(0)))).start()\nreturn y"),
}


@pytest.mark.slow
def test_candidate_python_cannot_reach_the_harness(cpu_verifier):
    results = cpu_verifier.map([(RELU_TASK, src) for src, _, _ in HARNESS_CASES.values()], timing=False, trials=2)
    for (name, (_, status, text)), result in zip(HARNESS_CASES.items(), results):
        assert result.status == status and text in result.message, (name, result)
    timed = cpu_verifier.map([(RELU_TASK, src) for src in TIMED_HARNESS_CASES.values()], trials=2)
    for name, result in zip(TIMED_HARNESS_CASES, timed):
        assert not result.correct, (name, result)
    assert cpu_verifier.verify(RELU_TASK, GOOD, trials=2).correct        # later candidates are served as usual


@pytest.mark.slow
def test_a_native_thread_left_after_unload_ends_its_worker(cpu_verifier):
    native = _model("import ctypes, time\nif not hasattr(ctypes, 'kept'):\n"
                    "    ctypes.kept = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda arg: time.sleep(60))\n"
                    "    ctypes.CDLL(None).pthread_create(ctypes.byref(ctypes.c_ulong()), None, ctypes.kept, None)\n"
                    "return x.clamp_min(0)")
    keepers = {w._process.pid for w in cpu_verifier._workers}
    cpu_verifier.verify(RELU_TASK, native, timing=False, trials=1)
    assert {w._process.pid for w in cpu_verifier._workers} != keepers      # its worker was replaced
    assert cpu_verifier.verify(RELU_TASK, GOOD, timing=False, trials=1).correct


TWO_OUTPUTS = ("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
               "        return torch.relu(x), torch.relu(x)\n\n\ndef get_inputs():\n    return [torch.randn(64, 64)]\n\n\n"
               "def get_init_inputs():\n    return []\n")
SHARED_OUTPUTS = TWO_OUTPUTS.replace("return torch.relu(x), torch.relu(x)", "y = torch.relu(x)\n        return y, y")


@pytest.mark.slow
def test_an_output_that_is_a_view_of_another_is_invalid_where_the_references_are_separate(cpu_verifier):
    """Issue #68, item 4: aliasing is compared with the reference's: a second output returned as a
    view of the first (the same values, half the work) is `invalid` where the reference returns two
    tensors; where the reference itself returns one tensor twice, so may the candidate."""
    separate, alias_ok = cpu_verifier.map([(TWO_OUTPUTS, _model("y = x.clamp_min(0)\nreturn y, y.view(y.shape)")),
                                           (SHARED_OUTPUTS, _model("y = x.clamp_min(0)\nreturn y, y"))], timing=False)
    assert separate.status == "invalid" and "shares memory with output 0" in separate.message, separate
    assert alias_ok.correct, alias_ok
