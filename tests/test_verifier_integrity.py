"""CPU tests of the verifier's fourth integrity round (issue #46): the GPU's records judged for a
switched-off recording and work left running, the precision rule per dtype and per reduction,
the heavy element of every trial, new integer draws, inputs modified in place, a refused hook's
verdict, GEMM epilogues learnt from the task, and DICE's own reward as an option. Each decision
is checked on hand-made records or plain references; the GPU side is in
`test_verifier_integrity_gpu.py`."""
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from dice.verifier import VerifyOptions
from dice.verifier.harness import (DOMINATED_KINDS, HEAVY_KINDS, call_draws, make_inputs, load_task, structured,
                                   timed_inputs, trial_inputs, trial_kinds, with_heavy)
from dice.verifier.kernel_names import qualified_name
from dice.verifier.outputs import compare_outputs
from dice.verifier.precision import (DICE_TOLERANCE, SERIAL, SERIAL_DOMINATED, own_error, reduction_terms, tolerances,
                                     unit)
from dice.verifier.records import activity, split_marker, unrecorded_launches
from dice.verifier.rules import kernel_problem
from dice.verifier.verdicts import trial_activity

FIXTURES = Path(__file__).parent / "fixtures" / "verifier"
RELU_TASK = (FIXTURES / "relu_task.py").read_text()
M = "spin_kernel(long)"                       # the marker's profiler name
RELU = "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_scalar>(int)"
GEMM = "nvjet_tst_128x64_64x4_1x2_h_bz_TNT"   # a Hopper GEMM whose name shows no epilogue


def gpu(name, start, end, correlation=0):
    return [name, start, end, correlation, True]


def api(name, start, end, correlation):
    return [name, start, end, correlation, False]


def task_source(forward: str, inputs: str, module_level: str = "") -> str:
    return (f"import torch\nimport torch.nn as nn\n{module_level}\n\nclass Model(nn.Module):\n"
            f"    def forward(self, x):\n        return {forward}\n\n\ndef get_inputs():\n    return [{inputs}]\n\n\n"
            "def get_init_inputs():\n    return []\n")


def model(forward: str, init: str = "pass", args: str = "x") -> str:
    body = "\n".join("        " + line for line in forward.strip().splitlines())
    return ("import torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    def __init__(self):\n"
            f"        super().__init__()\n        {init}\n\n    def forward(self, {args}):\n{body}\n")


# ---------------------------------------------------------------------------------------------
# Class 1: the profiler's recording switched while a candidate ran, found from the records.

def test_a_launch_without_its_device_record_is_found_from_the_correlation_ids():
    """CUPTI gives a launch call and the kernel it launched one correlation id; a kernel launched
    while the kernel records were off leaves the call alone. A driver call made inside a runtime
    call (the same launch) shares the device record of the call around it."""
    honest = [api("cudaLaunchKernel", 0, 10, 5), gpu("relu", 20, 30, 5), api("cudaMemcpyAsync", 40, 50, 6),
              gpu("Memcpy DtoH (Device -> Pageable)", 45, 60, 6), api("cudaDeviceSynchronize", 60, 70, 7)]
    assert unrecorded_launches(honest, ["kernel", "copy"]) == []
    nested = [api("cudaLaunchKernel", 0, 100, 8), api("cuLaunchKernel", 10, 90, 9), gpu("k", 120, 130, 8)]
    assert unrecorded_launches(nested, ["kernel"]) == []
    hidden = honest + [api("cuLaunchKernel", 80, 90, 11), api("cudaMemcpyAsync", 95, 99, 12)]
    assert unrecorded_launches(hidden, ["kernel", "copy"]) == ["cuLaunchKernel", "cudaMemcpyAsync"]
    assert unrecorded_launches(hidden, ["copy"]) == ["cudaMemcpyAsync"]     # only the families the probe matched
    assert unrecorded_launches(hidden, []) == []
    ran = {"records": hidden + [gpu(M, 100, 101), gpu("Memcpy DtoH (Device -> Pageable)", 102, 103)]}
    assert "left no device record" in trial_activity(ran, M, ["kernel"])[1]


def test_a_trial_ends_with_the_marker_and_the_canary_copy_and_nothing_else():
    canary = gpu("Memcpy DtoH (Device -> Pageable)", 10_000, 10_500)
    joined = [gpu("own", 0, 5_000), gpu("side", 1_000, 9_000), gpu(M, 9_500, 9_600), canary]
    forward, problem = split_marker(joined, M, canary=True)
    assert problem is None and [r[0] for r in forward] == ["own", "side"]
    assert activity(forward)["dtoh"] == 0                          # the canary is the harness's copy
    # a short kernel that starts after the marker ends within the old 2 us slack: still late
    quick = joined[:3] + [gpu("side_write", 9_700, 9_900), canary]
    assert "side_write was still running" in split_marker(quick, M, canary=True)[1]
    assert "copies was switched off" in split_marker(joined[:3], M, canary=True)[1]
    assert "timing markers" in split_marker(joined[:2], M, canary=True)[1]      # the recording stopped


# ---------------------------------------------------------------------------------------------
# Class 2: an estimate from part of a tensor, against the heavy element of every trial.

def test_every_structured_trial_and_timed_call_gets_one_heavy_element():
    x, idx = torch.rand(64, 128) + 0.5, torch.randint(0, 7, (50,))
    for kind in HEAVY_KINDS:
        plain = structured([x, idx], kind, 3)
        heavy = with_heavy(plain, kind, 3)
        changed = heavy[0] != plain[0]
        assert int(changed.sum()) == 1 and torch.equal(heavy[1], plain[1])          # integers untouched
        assert float(heavy[0][changed]) == pytest.approx(float(plain[0].abs().max()) * x.numel())
        assert heavy[0][changed].item() > plain[0][~changed].sum().item() / 2       # about half of the sum
        assert torch.equal(with_heavy(plain, kind, 3)[0], heavy[0])                 # the same in every process
    for kind in ("iid", "hot", "plain", "permuted", "light"):      # trial 1's outputs hold the precision at scale
        assert torch.equal(with_heavy([x], kind, 3)[0], x)
    half = with_heavy([torch.rand(1 << 16).half()], "spiked", 5)[0]
    assert half.max() == torch.finfo(torch.float16).max / 2 and torch.isfinite(half).all()   # fp16: half its range
    assert int((timed_inputs([x], 9, 4)[0] > 2).sum()) == 1                   # timed calls too


@pytest.mark.parametrize("dtype, numel", [(torch.float32, 1 << 16), (torch.float16, 1 << 20)])
def test_an_estimate_from_part_of_a_tensor_fails_every_heavy_trial_whatever_it_reads(dtype, numel):
    """A mean from a fraction f of the elements (a prefix, a stride, a fixed random subset),
    scaled by 1/f, either misses the heavy element or holds it 1/f-fold: an error above 1e-2 on
    every seed and every heavy kind at f <= 0.7 in float32. fp16's range caps the heavy element
    at 32752, ~6% of a mean of 2^20 values drawn in [0, 1) (1.5% once scaled 4-fold): f <= 1/2
    fails every kind, f = 0.7 the unscaled (spiked) ones. No sample of a few elements shows the
    trial apart: the others are the kind's own values."""
    perm = torch.randperm(numel, generator=torch.Generator().manual_seed(0))
    ways = {"prefix": lambda v, f: v[: int(f * v.numel())], "stride": lambda v, f: v[:: round(1 / f)],
            "fixed random": lambda v, f: v[perm[: int(f * v.numel())]]}
    for seed in range(3):
        x = torch.rand(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)
        for kind in ("spiked", "scaled"):
            heavy = trial_like(x, kind, seed).float()
            expected = heavy.mean().reshape(1)
            for name, part in ways.items():
                for f in (1 / 8, 1 / 2, 0.7):
                    if f == 0.7 and (name == "stride" or dtype == torch.float16 and kind == "scaled"):
                        continue
                    got = part(heavy, f).mean().reshape(1)
                    assert compare_outputs([expected], [got], 1e-2, 1e-2) is not None, (seed, kind, name, f)
            sample = torch.randint(numel, (32,), generator=torch.Generator().manual_seed(seed))
            assert heavy[sample].max() < 8          # 32 samples: no heavy element among them


def trial_like(x: torch.Tensor, kind: str, seed: int) -> torch.Tensor:
    return with_heavy(structured([x], kind, seed), kind, seed)[0]


# ---------------------------------------------------------------------------------------------
# Class 6 and item 3: the strict precision for a reduction by atomics, and for a downgraded GEMM.

def _serial(terms: torch.Tensor, seed: int) -> torch.Tensor:
    """float32 additions one after another in a random order, as atomics into one float do."""
    order = np.random.default_rng(seed).permutation(terms.numel())
    return torch.tensor(np.add.accumulate(terms.numpy()[order], dtype=np.float32)[-1])


def _strict(reference: torch.Tensor, exact: torch.Tensor, inputs: list, kind: str = "iid") -> list:
    """The strict rule's [atol, rtol, rel_l2] for `reference` on a trial of `kind`, as the judge
    measures them (`judge._own_error`)."""
    share = SERIAL_DOMINATED if kind in DOMINATED_KINDS else SERIAL
    return tolerances([reference], [(*own_error(reference, exact), reduction_terms(inputs, reference), share)],
                      "strict")[0]


@pytest.mark.slow
@pytest.mark.parametrize("n", [1 << 14, 1 << 16, 1 << 17, 1 << 18, 1 << 20])
def test_a_mean_added_by_atomics_is_correct_on_every_trial(n):
    """Honest controls once refused: an MSE on an H200 (3.3e-4 off at 0.403), a mean of 2^20 values
    on an H100 (0.783% off on a spiked trial, 0.781% allowed), and here means of 2^17 values on the
    hot trial and of 2^18 on a spiked one, where the terms below half a unit of the dominant
    element's running sum are lost. Added one by one in float32, in 4 random orders, on every
    default trial, an MSE and a mean pass the strict rule; with 1/8 of the serial worst case on every
    trial (the rule before) the means of 2^17 and 2^18 fail, and with no serial allowance at all
    the mean of 2^20 does."""
    failed_before, failed_without = [], []
    for i, kind in enumerate(trial_kinds(5)):
        x = trial_like(torch.rand(n, generator=torch.Generator().manual_seed(i)), kind, i)
        for name, values in (("mse", (x - 0.5) ** 2), ("mean", x)):
            reference, exact = values.mean(), values.double().mean()
            allowed, before = _strict(reference, exact, [x], kind), _strict(reference, exact, [x])
            without = tolerances([reference], [own_error(reference, exact)], "strict")[0]
            for order in range(4):
                atomics = _serial(values / n, 10 * i + order)
                assert compare_outputs([reference], [atomics], *allowed) is None, (name, kind, order)
                failed_before.append(compare_outputs([reference], [atomics], *before) is not None)
                failed_without.append(compare_outputs([reference], [atomics], *without) is not None)
    assert any(failed_before) == (n in (1 << 17, 1 << 18))
    assert any(failed_without) or n < 1 << 20
    assert reduction_terms([torch.zeros(n)], torch.zeros(())) == n


def test_tf32_and_fp16_gemms_stay_incorrect_under_the_strict_rule():
    """A GEMM's output is as large as its operands, so no serial allowance: a product on TF32- or
    fp16-rounded operands (~4e-4 of the output's scale) fails; the exact product summed in float64
    and rounded passes."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(128, 1024, generator=g), torch.randn(1024, 128, generator=g)
    tf32 = lambda t: ((t.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)  # noqa: E731
    reference, exact = a @ b, a.double() @ b.double()
    allowed = _strict(reference, exact, [a, b])
    assert compare_outputs([reference], [tf32(a) @ tf32(b)], *allowed) is not None
    assert compare_outputs([reference], [(a.half() @ b.half()).float()], *allowed) is not None
    assert compare_outputs([reference], [exact.float()], *allowed) is None


def test_each_dtype_is_held_to_its_own_precision():
    """float64 at float32's tolerances scaled by 2^-29 (1e-4 -> 1.9e-13), complex by its component
    dtype, fp16 at 1e-2; complex outputs get the whole-output error that catches garbage below atol."""
    f64, c64, c128, f16 = (torch.zeros(3, dtype=d) for d in (torch.float64, torch.complex64, torch.complex128,
                                                              torch.float16))
    scale = unit(torch.float64) / unit(torch.float32)
    assert tolerances([f64, c64, c128, f16], None, "strict") == [
        [pytest.approx(1e-4 * scale)] * 2 + [pytest.approx(1e-3 * scale)], [1e-4, 1e-4, 1e-3],
        [pytest.approx(1e-4 * scale)] * 2 + [pytest.approx(1e-3 * scale)], [DICE_TOLERANCE] * 3]
    x = torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert compare_outputs([x], [x.float().double()], *tolerances([x], None, "strict")[0]) is not None
    assert compare_outputs([x], [x * (1 + 1e-15)], *tolerances([x], None, "strict")[0]) is None
    # a float64 output with cancellation: its own error, measured in float32 and scaled, loosens atol
    y = (x + 4096.0) - 4096.0
    loose = tolerances([y], [own_error(y, ((x.float() + 4096.0) - 4096.0).double(), scale)], "strict")[0]
    assert compare_outputs([y], [x], *loose) is None and compare_outputs([y], [x], *tolerances([y], None, "strict")[0])
    z = torch.complex(x.float(), x.flip(0).float()) * 1e-7
    assert "relative error" in compare_outputs([z], [z * 0.5], 1e-2, 1e-2)
    strict, dice = tolerances([z / 1e-7], None, "strict")[0], tolerances([z], None, "dice")[0]
    assert compare_outputs([z / 1e-7], [z / 1e-7 * (1 + 2e-7)], *strict) is None        # float32's rounding
    half = torch.view_as_complex(torch.view_as_real(z / 1e-7).half().float())          # fp16 components
    assert compare_outputs([z / 1e-7], [half], *strict) is not None
    assert compare_outputs([z / 1e-7], [half], *dice) is None


# ---------------------------------------------------------------------------------------------
# Item 2: integers drawn anew, complex inputs structured.

IMPORT_SUM = task_source("x.sum().float()", "X", "X = torch.randint(0, 100, (4096,))\n")


def test_integer_inputs_are_new_draws_on_every_trial_and_timed_call():
    """A task that draws its integers once at import, with an output their order does not change:
    permutations of that draw give the same output every time; with the task's source each trial
    and timed call draws anew (the task imported under a seed of its own), in the task's range."""
    task = load_task(IMPORT_SUM, "dice_test_task")
    sums = {int(trial_inputs(task, seed, "iid", torch.device("cpu"), IMPORT_SUM)[0].sum()) for seed in range(5)}
    assert len(sums) == 5
    assert len({int(trial_inputs(task, seed, "iid", torch.device("cpu"))[0].sum()) for seed in range(5)}) == 1
    again = trial_inputs(task, 3, "iid", torch.device("cpu"), IMPORT_SUM)[0]
    assert torch.equal(again, trial_inputs(task, 3, "iid", torch.device("cpu"), IMPORT_SUM)[0])   # every process alike
    assert 0 <= int(again.min()) and int(again.max()) < 100
    pristine = make_inputs(task, 7, torch.device("cpu"), IMPORT_SUM)
    draws = call_draws(task, IMPORT_SUM, 7, torch.device("cpu"), pristine)
    assert len({int(timed_inputs(draws(k), 7, k)[0].sum()) for k in range(4)}) == 4



def test_every_timed_call_draws_anew_so_no_sign_pattern_repeats():
    """Issue #68, item 3: a cache keyed on any property of the inputs (here their signs, which a
    jitter keeps) must meet a new key on every timed call, for a task drawing in get_inputs and for
    one drawing once at import (imported anew for each call's draw)."""
    fixed = RELU_TASK.replace("def get_inputs():\n    return [torch.randn(256, 1024)]",
                              "X = torch.randn(256, 1024)\n\n\ndef get_inputs():\n    return [X]")
    assert fixed != RELU_TASK
    for source in (RELU_TASK, fixed):
        task = load_task(source, "dice_test_signs")
        pristine = make_inputs(task, 7, torch.device("cpu"), source)
        draws = call_draws(task, source, 7, torch.device("cpu"), pristine)
        signs = {tuple(timed_inputs(draws(k), 7, k)[0].reshape(-1)[:64].sign().tolist()) for k in range(6)}
        assert len(signs) == 6, source
        jittered = {tuple(timed_inputs(pristine, 7, k)[0].reshape(-1)[:64].sign().tolist()) for k in range(6)}
        assert len(jittered) == 1              # jitter alone keeps one draw's signs: what the cache keyed on


def test_complex_inputs_take_the_trials_structure():
    c = torch.randn(64, 32, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    for kind in ("iid", "hot", "spiked", "scaled"):
        assert not torch.equal(trial_like(c, kind, 1), c), kind
    hot = structured([c], "hot", 1)[0]
    assert int((torch.view_as_real(hot).abs() > 1e-3).sum()) == 1


# ---------------------------------------------------------------------------------------------
# Class 5: a library GEMM's epilogue learnt from what launches it.

def test_a_gemm_kernel_the_judge_saw_compute_an_activation_is_library_compute():
    """The judge runs the task's products with and without an activation epilogue and labels the
    kernels only the activation launched (`epilogues`); such a kernel in the candidate's forward
    is a "gemm+relu", which the reference's plain GEMM does not cover."""
    noops = {"dtoh": 0, "htod": 0}
    decoy = {"noop": 1, GEMM: 1}
    reference = {"sm90_xmma_gemm_f32f32_tn_n": 1, RELU: 1}
    assert kernel_problem(decoy, {"noop"}, reference, noops, noops, qualified_name) is None   # by name: passes
    problem = kernel_problem(decoy, {"noop"}, reference, noops, noops, qualified_name, epilogues={GEMM: ["relu"]})
    assert "library compute the reference does not (gemm+relu)" in problem
    honest = {"bias_relu": 1, "nvjet_plain_TNT": 1}
    assert kernel_problem(honest, {"bias_relu"}, reference, noops, noops, qualified_name,
                          epilogues={GEMM: ["relu"]}) is None


def test_the_products_a_reference_computes_are_read_at_dispatch():
    from dice.verifier.epilogues import _layouts, gemm_operands
    linear = torch.nn.Linear(64, 32)
    seen = gemm_operands(lambda: torch.relu(linear(torch.randn(4, 8, 64))))
    assert seen == {(((32, 64), (64, 1), torch.float32), ((64, 32), (1, 64), torch.float32))}
    assert _layouts((32, 64), (64, 1)) == {(64, 1), (1, 32)}


UNFUSED = """
import math, torch
from dice.verifier import guard
from dice.verifier.epilogues import unfuse_activations
bias, a, b = torch.randn(8), torch.randn(4, 6), torch.randn(6, 8)
product = bias + a @ b
unfuse_activations("cpu")
before = guard.callbacks()
with torch.profiler.profile() as prof:
    relu = torch._addmm_activation(bias, a, b)
gelu = torch._addmm_activation(bias, a, b, use_gelu=True)
tanh_gelu = 0.5 * product * (1 + torch.tanh(math.sqrt(2 / math.pi) * (product + 0.044715 * product ** 3)))
print(sorted({e.name for e in prof.events()} & {"aten::relu_", "aten::addmm"}))
print(torch.allclose(relu, product.clamp_min(0), atol=1e-5), torch.allclose(gelu, tanh_gelu, atol=1e-5))
print(guard.callbacks_changed(before))
lib = torch.library.Library("aten", "IMPL")
import warnings; warnings.simplefilter("ignore")
lib.impl("_addmm_activation", lambda *args, **kwargs: args[0], "CPU")
print(guard.callbacks_changed(before))
"""


def test_the_worker_computes_a_fused_activation_as_its_own_kernel():
    """On the H200 a ReLU epilogue runs in the plain product's nvjet kernel, so in the worker
    torch._addmm_activation is the product with a bias, then the activation as aten's unfused path
    computes it (relu_, gelu_ with the tanh estimate: the formula written out here); a candidate
    that registers its own kernel for the op is named by the guard. In a fresh interpreter (the
    registration lasts as long as the process), on the CPU's dispatch key."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", UNFUSED], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    ops, results, untouched, replaced = done.stdout.splitlines()[-4:]
    assert ops == "['aten::addmm', 'aten::relu_']" and results == "True True", done.stdout
    assert untouched == "[]" and "aten::_addmm_activation" in replaced, done.stdout


@pytest.mark.parametrize("line", ["cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_RELU_BIAS;",
                                  "at::cuda::blas::gemm_and_bias<float>(true, false, m, n, k, 1.0f, a, lda, b, ldb,",
                                  "auto act = at::cuda::blas::GEMMAndBiasActivationEpilogue::GELU;"])
def test_compiled_code_naming_an_activation_epilogue_is_invalid_under_the_strict_rule(line):
    """What the worker's unfusing cannot reach, a compiled extension calling cuBLASLt itself, is
    refused where the source names it (strict rule only: KernelBench's rules allow library work)."""
    from dice.verifier.results import static_check
    source = (f'import torch\nfrom torch.utils.cpp_extension import load_inline\nsrc = """\n{line}\n'
              '__global__ void noop() {}\n"""\nclass ModelNew(torch.nn.Module):\n    pass\n')
    verdict = static_check(source, need_kernel=True, rules="strict")
    assert verdict is not None and verdict.status == "invalid" and "activation epilogue" in verdict.message
    assert static_check(source, need_kernel=True, rules="kernelbench") is None
    plain = source.replace(line, "cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BIAS;")
    assert static_check(plain, need_kernel=True, rules="strict") is None


# ---------------------------------------------------------------------------------------------
# Item 4: DICE's own reward as an option.

def test_the_dice_reward_rules_are_dices_own_check():
    from types import SimpleNamespace

    from dice.config import TrainConfig, UsageError
    from dice.protocols import DICE_REWARD
    from dice.rl.reward import verifier_reward
    from dice.rl.train_rl import RESUME_FIELDS
    from dice.sampling.completion import Completion
    from dice.tasks.load import Task

    seen = []

    class Recording:
        def map(self, pairs, on_broken_task=None, **options):
            seen.append(options)
            return [SimpleNamespace(correct=True, compiled=True, speedup=1.0) for _ in pairs]

    tasks, done = [Task("a", 1, "src")], [Completion([1], [2], [1], "", "code")]
    verifier_reward(Recording(), "e2e", rules="dice")(tasks, done)
    verifier_reward(Recording(), "e2e")(tasks, done)
    assert seen[0] == {"timing": False, "rules": "dice", "precision": "dice", "trials": 1, "timeout_s": 300.0,
                       "atol": 1e-2, "rtol": 1e-2, "rel_l2": float("inf")}
    assert seen[0] == {"timing": False, **DICE_REWARD}
    assert seen[1] == {"timing": False, "trials": 3, "timeout_s": 60.0}         # ours stays the default
    assert TrainConfig(phase="e2e").reward_rules == "strict" and "reward_rules" in RESUME_FIELDS
    assert TrainConfig(phase="e2e", reward_rules="dice").reward_rules == "dice"
    with pytest.raises(UsageError, match="--reward-rules must be one of strict, dice"):
        TrainConfig(phase="e2e", reward_rules="loose")
    assert VerifyOptions(**DICE_REWARD).rules == "dice"


# ---------------------------------------------------------------------------------------------
# Through the pool (CPU mode): refusals, inputs modified in place, float64 and complex, DICE's check.

HARNESS_REFUSALS = {   # each refused, and the refusal reaches the verdict: invalid, with the reason
    "sys.setprofile at import": ("import sys\nsys.setprofile(lambda *a: None)\n", "return x.clamp_min(0)",
                                 "refuses sys.setprofile"),
    "the profiler's dynamic toggle": ("", "import torch.autograd.profiler as p\n"
                                      "p._toggle_collection_dynamic(False, set())\nreturn x.clamp_min(0)",
                                      "_toggle_collection_dynamic"),
    "torch.profiler around forward": ("", "with torch.profiler.profile():\n    y = x.clamp_min(0)\nreturn y",
                                      "refuses torch's profiler control"),
    "a CUPTI binding imported": ("", "from cupti import cupti\nreturn x.clamp_min(0)", "refuses import of cupti"),
    "libcupti opened through ctypes": ("", "import ctypes\nctypes.CDLL('libcupti.so.12')\nreturn x.clamp_min(0)",
                                       "refuses ctypes.dlopen"),
    "a CUPTI function looked up": ("", "import ctypes\nctypes.CDLL(None).cuptiActivityDisable\nreturn x.clamp_min(0)",
                                   "refuses ctypes.dlsym"),
}


@pytest.mark.slow
def test_a_refused_hook_or_profiler_switch_is_invalid_with_its_reason(cpu_verifier):
    cases = [(RELU_TASK, top + model(forward)) for top, forward, _ in HARNESS_REFUSALS.values()]
    results = cpu_verifier.map(cases, timing=False, trials=1)
    for (name, (_, _, text)), result in zip(HARNESS_REFUSALS.items(), results):
        assert result.status == "invalid" and text in result.message, (name, result)
    assert cpu_verifier.verify(RELU_TASK, model("return x.clamp_min(0)"), timing=False, trials=1).correct


IN_PLACE_TASK = task_source("x.mul_(2).sum(0)", "torch.randn(64, 32)")
FP64_TASK = task_source("x @ x.t()", "torch.randn(128, 64, dtype=torch.float64)")
FP64_ROUNDED_TASK = task_source("(x + 4096.0) - 4096.0", "torch.randn(4096, dtype=torch.float64)")
COMPLEX_TASK = task_source("x * x", "X", "X = torch.randn(64, 64, dtype=torch.complex64)\n")
BOUNDED_TASK = task_source("torch.relu(x) if x.abs().max() < 100 else None.fail", "torch.randn(64, 64)")
POOL_CASES = {   # name: (task, candidate, verdict, text)
    "an input the reference doubles, doubled": (IN_PLACE_TASK, model("return x.mul_(2).sum(0)"), "correct", ""),
    "an input the reference doubles, left alone": (IN_PLACE_TASK, model("return (2 * x).sum(0)"), "incorrect",
                                                   "input 0 is unchanged"),
    "an input the reference doubles, tripled": (IN_PLACE_TASK, model("s = (2 * x).sum(0)\nx.mul_(3)\nreturn s"),
                                                "incorrect", "input 0 after forward differs"),
    "a float64 product summed in another order": (FP64_TASK, model("return torch.einsum('ik,jk->ij', x, x)"),
                                                  "correct", ""),
    "a float64 product computed in float32": (FP64_TASK, model("return (x.float() @ x.float().t()).double()"),
                                              "incorrect", "rtol=1.86265e-13"),
    "float64 cancellation within the reference's own rounding": (FP64_ROUNDED_TASK, model("return x.clone()"),
                                                                 "correct", ""),
    "complex product": (COMPLEX_TASK, model("return x * x"), "correct", ""),
    # a reference that raises on the heavy element: its trials keep their jitter, without one
    "a bounded task, honest": (BOUNDED_TASK, model("return x.clamp_min(0)"), "correct", ""),
    "a bounded task, off by 1%": (BOUNDED_TASK, model("return x.clamp_min(0) * 1.01"), "incorrect", ""),
    "complex product replayed from one trial": (COMPLEX_TASK, model(
        "if self.out is None:\n    self.out = x * x\nreturn self.out.clone()", init="self.out = None"),
        "incorrect", ""),
    "complex product in half precision": (COMPLEX_TASK, model(
        "r = torch.view_as_real(x).half()\nre, im = r[..., 0], r[..., 1]\n"
        "return torch.complex((re * re - im * im).float(), (2 * re * im).float())"), "incorrect", ""),
}


@pytest.mark.slow
def test_inputs_modified_in_place_and_float64_and_complex_outputs_are_checked_for_what_they_are(cpu_verifier):
    results = cpu_verifier.map([(task, src) for task, src, _, _ in POOL_CASES.values()], timing=False, seed=4)
    for (name, (_, _, status, text)), result in zip(POOL_CASES.items(), results):
        assert result.status == status and text in result.message, (name, result)
    key = hashlib.sha256(BOUNDED_TASK.encode()).hexdigest()
    bounded = {"task_src": BOUNDED_TASK, "task_key": key, "precision": "strict"}
    assert cpu_verifier._plans.kinds(bounded, 1, [1, 2, 3, 4, 5]) == ["iid", "light", "hot", "light", "light"]
    timed = cpu_verifier.verify(BOUNDED_TASK, model("return x.clamp_min(0)"), seed=4)   # timed calls jittered, light
    assert timed.correct and timed.speedup > 0, timed


FP16_MEAN_TASK = task_source("x.mean()", "torch.rand(1 << 20).half()")
FALLBACK = model("try:\n    import no_such_kernels\n    return no_such_kernels.relu(x)\nexcept ImportError:\n"
                 "    return torch.relu(x)")


@pytest.mark.slow
def test_dices_check_passes_what_the_strict_one_refuses(cpu_verifier):
    """`rules="dice"` (train.py --reward-rules dice): one trial on the inputs as drawn at 1e-2, no
    kernel or fallback rule; a mean from 70% of an fp16 tensor and a PyTorch fallback pass it and
    fail ours."""
    from dice.protocols import DICE_REWARD
    estimate = model("return (x[: int(0.7 * x.numel())].float().sum() / (0.7 * x.numel())).half()")
    pairs = [(FP16_MEAN_TASK, estimate), (RELU_TASK, FALLBACK)]
    dice = cpu_verifier.map(pairs, timing=False, **DICE_REWARD)
    strict = cpu_verifier.map(pairs, timing=False)
    assert [r.status for r in dice] == ["correct", "correct"], dice
    assert [r.status for r in strict] == ["incorrect", "invalid"], strict
    assert "1 trials" in dice[0].message
