"""The verifier's decisions on recorded data (DESIGN.md §8): the kernel rule on hand-made kernel
lists, own kernels read from machine code, the tolerance that atol cannot hide, the structured
trial inputs, and (with pure-PyTorch candidates on the CPU) the cheats those trials catch."""
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dice.verifier import VerifyOptions
from dice.verifier.harness import HOT_FADE, JITTER, SPIKE, SPIKE_EVERY, structured, timed_inputs, trial_kinds
from dice.verifier.kernel_names import entry_symbols, library_kernel_names, qualified_from_mangled, qualified_name
from dice.verifier.outputs import compare_outputs, relative_error
from dice.verifier.precision import own_error, tolerances
from dice.verifier.records import activity, busy_ns, split_marker
from dice.verifier.rules import kernel_problem
from dice.verifier.speedup import estimate, stable

FIXTURES = Path(__file__).parent / "fixtures" / "verifier"
GEMM_A = "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off"
GEMM_B = "ampere_sgemm_128x64_nn"          # another of cuBLAS's kernels for the same product
RELU = "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_scalar>(int)"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float> >(int)"
MAX = "void at::native::vectorized_elementwise_kernel<4, at::native::maximum_kernel_cuda>(int)"
FILL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)"
COPY = "void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda>(int)"
NO_COPIES = {"dtoh": 0, "htod": 0}


def problem(launched, own, reference, copies=NO_COPIES, reference_copies=NO_COPIES, rules="strict"):
    return kernel_problem(launched, set(own), reference, copies, reference_copies, qualified_name, rules)


def test_an_own_kernel_alone_passes_and_no_own_kernel_fails():
    assert problem({"relu_kernel(float const*, float*, long)": 1}, {"relu_kernel"}, {RELU: 1}) is None
    assert "none of the kernels" in problem({RELU: 1}, set(), {RELU: 1})
    # declared in a string, never compiled: the name is not among the compiled ones
    assert "none of the kernels" in problem({RELU: 1}, {"other_kernel"}, {RELU: 1})


def test_a_decoy_beside_the_references_own_ops_is_invalid():
    """One own kernel launched (a no-op or a copy) while the work is done by the reference's op:
    a tensor method, torch.ops.aten, an at:: call in a load_inline wrapper, the Model held as a
    submodule all launch the reference's kernels."""
    assert "decoy" in problem({"noop": 1, RELU: 1}, {"noop"}, {RELU: 1})
    assert "decoy" in problem({"noop": 1, GEMM_A: 1, ADD: 1}, {"noop"}, {GEMM_A: 1, ADD: 1})
    # cuBLAS through cupy.matmul on a matmul task: another GEMM kernel, still the reference's step
    assert "decoy" in problem({"noop": 1, GEMM_B: 1}, {"noop"}, {GEMM_A: 1})
    # pure data movement done by .t().contiguous() beside a decoy
    assert "decoy" in problem({"noop": 1, COPY: 1}, {"noop"}, {COPY: 1})


def test_a_gemm_kept_in_pytorch_with_an_own_epilogue_passes():
    """KernelBench Level 2: the library GEMM kept (cuBLAS may pick another kernel for the
    candidate's layout), bias and activation fused into an own kernel, zeros allocated on the way."""
    assert problem({GEMM_B: 1, "bias_relu(float*, float const*, long)": 1, FILL: 1}, {"bias_relu"},
                   {GEMM_A: 1, ADD: 1, RELU: 1}) is None
    # two reference adds, one fused into the own kernel, one kept: a step was replaced
    assert problem({ADD: 1, "fused": 1}, {"fused"}, {ADD: 2, RELU: 1}) is None
    # cuBLAS split-K: two GEMM-class kernels for the one product the reference also makes
    assert problem({GEMM_B: 1, "splitKreduce_kernel": 1, "epilogue": 1}, {"epilogue"}, {GEMM_A: 1, RELU: 1}) is None


def test_a_cupy_kernel_is_the_candidates_only_when_its_own_code_asked_for_it(tmp_path):
    """`requested_by_candidate` on real call stacks: a library under CuPy's folders (here a stand-in
    `cupy/compiler.py`) compiling for candidate.py's code is the candidate's; the same compile asked
    for by a library on top of CuPy (a stand-in `cupyx/filters.py`, as cupyx.scipy.ndimage's
    correlate compiles its own kernels) or by the harness is not."""
    import sys
    import types

    from dice.verifier.harness import CANDIDATE_FILE
    from dice.verifier.kernels import requested_by_candidate
    folders = {name: tmp_path / "site" / name for name in ("cupy", "cupyx")}
    sources = {"cupy": "def compile_with_cache(check):\n    return check()\n",
               "cupyx": "def correlate(compile_with_cache, check):\n    return compile_with_cache(check)\n"}
    modules = {}
    for name, folder in folders.items():
        folder.mkdir(parents=True)
        path = folder / "lib.py"
        path.write_text(sources[name])
        modules[name] = types.ModuleType(name)
        exec(compile(sources[name], str(path), "exec"), modules[name].__dict__)
    skip = (str(folders["cupy"]) + "/",)
    check = lambda: requested_by_candidate(sys._getframe(1), skip)   # noqa: E731  called where CuPy compiles
    candidate = types.ModuleType("candidate")
    exec(compile("def own(cupy, check):\n    return cupy.compile_with_cache(check)\n\n"
                 "def through_cupyx(cupy, cupyx, check):\n    return cupyx.correlate(cupy.compile_with_cache, check)\n",
                 CANDIDATE_FILE, "exec"), candidate.__dict__)
    assert candidate.own(modules["cupy"], check) is True
    assert candidate.through_cupyx(modules["cupy"], modules["cupyx"], check) is False
    assert modules["cupy"].compile_with_cache(check) is False      # asked for by this file: the harness's
    # a standard-library frame between CuPy and the candidate (a `with` in CuPy) is passed over;
    # one of a package installed under the standard library's folder is a library's
    stdlib_dir = tmp_path / "lib" / "python3"
    for folder, expected in ((stdlib_dir, True), (stdlib_dir / "site-packages" / "lib", False)):
        folder.mkdir(parents=True, exist_ok=True)
        relay = types.ModuleType("relay")
        exec(compile("def call(f, *a):\n    return f(*a)\n", str(folder / "relay.py"), "exec"), relay.__dict__)
        exec(compile("def via(relay, cupy, check):\n    return relay.call(cupy.compile_with_cache, check)\n",
                     CANDIDATE_FILE, "exec"), candidate.__dict__)
        stdlib_check = lambda: requested_by_candidate(sys._getframe(1), skip, (str(stdlib_dir) + "/",))  # noqa: E731
        assert candidate.via(relay, modules["cupy"], stdlib_check) is expected, folder


def test_library_compute_the_reference_lacks_is_invalid():
    assert "library compute" in problem({"mine": 1, MAX: 1}, {"mine"}, {RELU: 1})
    assert "library compute" in problem({"mine": 1, ADD: 2}, {"mine"}, {ADD: 1, RELU: 1})   # more often
    div = "void at::native::vectorized_elementwise_kernel<4, at::native::BUnaryFunctor<float, float, float, DivFunctor> >(int)"
    assert "library compute" in problem({"sum_kernel": 1, div: 1}, {"sum_kernel"}, {ADD: 1, RELU: 1})   # glue counts
    assert problem({"mine": 1, MAX: 1}, {"mine"}, {RELU: 1}, rules="kernelbench") is None  # the lax rule


def test_a_compiled_kernel_that_shares_a_reference_kernels_name_is_the_references():
    """Spoofing: the candidate compiles a kernel named like the library one it then calls."""
    spoof = "at::native::vectorized_elementwise_kernel"
    assert "none of the kernels" in problem({RELU: 1}, {spoof}, {RELU: 1})
    assert "none of the kernels" in problem({GEMM_A: 1}, {GEMM_A}, {GEMM_A: 1})


def test_host_round_trips_are_invalid_unless_the_reference_makes_them():
    host = {"dtoh": 1, "htod": 1}
    assert "host" in problem({"noop": 1}, {"noop"}, {RELU: 1}, copies=host)
    assert problem({"noop": 1}, {"noop"}, {RELU: 1}, copies=host, reference_copies={"dtoh": 1, "htod": 0}) is None
    assert problem({"noop": 1}, {"noop"}, {RELU: 1}, copies={"dtoh": 0, "htod": 1}) is None   # constants uploaded


def test_library_compute_is_classified_from_what_the_reference_launches():
    softmax = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(float*)"
    sdpa = "fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float>::Params)"
    # a fused attention kernel is no GEMM, though its name holds "cutlass": library compute of its own
    assert "library compute" in problem({"noop": 1, sdpa: 1}, {"noop"}, {GEMM_A: 2, softmax: 1})
    # a cuBLASLt epilogue doing the task's bias and activation: not the reference's plain GEMM
    lt_relu = "nvjet_tst_128x64_64x4_1x2_h_bz_bias_relu_TNT"
    assert "library compute" in problem({"noop": 1, lt_relu: 1}, {"noop"}, {GEMM_A: 1, ADD: 1, RELU: 1})
    # a plain GEMM where the reference's GEMM adds the bias is the reference's (nn.Linear kept)
    lt_bias = "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_bias_tilesize128x128x32"
    assert problem({GEMM_B: 1, "bias_relu": 1}, {"bias_relu"}, {lt_bias: 1, RELU: 1}) is None
    # a reference step redone by a library copy (a flip as CuPy's copy of a reversed view) or by fills
    flip = "void at::native::(anonymous namespace)::flip_kernel<float>(float*)"
    assert "decoy" in problem({"noop": 1, "cupy_copy__float32_float32": 1}, {"noop"}, {flip: 1})
    masked = "void at::native::masked_fill_kernel<float>(float*)"
    assert "decoy" in problem({"noop": 1, FILL: 4, softmax: 1}, {"noop"}, {masked: 1, softmax: 1})
    # honest: an own flip; an own gather into a zeroed output; an own masked softmax with a zeroed buffer
    assert problem({"own_flip": 1}, {"own_flip"}, {flip: 1}) is None
    gather = "void at::native::index_elementwise_kernel<128, 4, gather_lambda>(int)"
    assert problem({"own_gather": 1, FILL: 1}, {"own_gather"}, {gather: 1}) is None
    assert problem({"own": 1, FILL: 1}, {"own"}, {masked: 1, softmax: 1}) is None
    # a host computation read back without a host-to-device copy (mapped memory)
    assert "host" in problem({"own": 1}, {"own"}, {RELU: 1}, copies={"dtoh": 1, "htod": 0})


def test_a_kernel_named_like_a_library_kernel_is_not_the_candidates_own():
    """The name a kernel launch shows is all CUPTI gives; a compiled kernel that shares it with
    torch or a CUDA library is refused, as is one the reference launches."""
    from dice.verifier.results import VerifyOptions
    from dice.verifier.verdicts import kernel_verdict
    softmax = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(float*)"
    forward = {"kernels": {softmax: 1}, "dtoh": 0, "htod": 0, "busy_ms": 0.01}
    reference = {"kernels": {"exp_kernel": 1, "sum_kernel": 1, "div_kernel": 1}, "dtoh": 0, "htod": 0}
    assert kernel_verdict(forward, ["softmax_warp_forward"], reference, VerifyOptions()) is None   # unknown: own
    refused = kernel_verdict(forward, ["softmax_warp_forward"], reference, VerifyOptions(),
                             frozenset({"softmax_warp_forward"}))
    assert "name of a kernel in torch" in refused


needs_cxx = pytest.mark.skipif(not shutil.which("c++"), reason="needs a C++ compiler")


@needs_cxx
def test_library_kernel_names_are_read_from_a_librarys_read_only_data(tmp_path, monkeypatch):
    """nvcc registers each kernel by its mangled name, a string literal: a host library built
    here with such strings (and other text) gives their qualified names, and nothing else."""
    (tmp_path / "lib.cpp").write_text(
        'extern "C" const char* names[] = {"_ZN12_GLOBAL__N_120softmax_warp_forwardIfEEvPf", "_Z10dot_kernelPf",\n'
        '    "_ZN2at6native13reduce_kernelEv", "plain text, not a name"};\n')
    subprocess.run(["c++", "-shared", "-fPIC", "-O0", "-o", str(tmp_path / "libfake.so"), str(tmp_path / "lib.cpp")],
                   check=True)
    paths = [tmp_path / "libfake.so", tmp_path / "lib.cpp", tmp_path / "missing.so"]
    names = library_kernel_names(paths)
    assert names == {"softmax_warp_forward", "dot_kernel", "at::native::reduce_kernel"}
    # read once per process (every Verifier asks), again once a library changes
    import os

    from dice.verifier import kernel_names
    reads = []
    monkeypatch.setattr(kernel_names, "_read_only_sections", lambda f: reads.append(f.name) or [])
    assert library_kernel_names(paths) == names and not reads
    os.utime(tmp_path / "libfake.so", ns=(1, 1))
    assert library_kernel_names(paths) == set() and reads == [str(p) for p in paths[:2]]


def test_busy_time_is_the_union_of_the_kernels_intervals():
    """Work on parallel streams counts once (`records.activity`'s busy_ms)."""
    assert busy_ns([(0, 10), (5, 20), (30, 40), (30, 35)]) == 30
    padded = [[f"pad{j}", 0, 12_500] for j in range(8)]
    assert activity(padded)["busy_ms"] == pytest.approx(0.0125)


def test_work_still_running_when_forward_returned_is_found_from_the_marker():
    """The marker runs on torch's current stream after forward returned: a side stream joined to
    it ends before the marker starts; one left running ends after (CUPTI's ns stamps)."""
    m = "spin_kernel(long)"
    joined = [["own", 0, 5_000], ["side", 1_000, 9_000], [m, 9_500, 9_600]]
    rest, problem = split_marker(joined, m)
    assert problem is None and rest == joined[:2]
    unjoined = [["own", 0, 5_000], ["side", 1_000, 60_000], [m, 5_500, 5_600]]
    assert "side was still running" in split_marker(unjoined, m)[1]
    assert "timing markers" in split_marker(joined + [[m, 100, 200]], m)[1]   # forward launched one itself
    assert activity(rest)["kernels"] == {"own": 1, "side": 1}


def test_the_next_call_writes_into_the_previous_calls_input_tensors():
    from dice.verifier.harness import rewritten_in_place
    task_tensor, previous = torch.randn(4, 3), [torch.randn(4, 3), torch.randn(2), 7]
    fresh = [torch.randn(4, 3), torch.randn(5), 7]
    out = rewritten_in_place(previous, fresh)
    assert out[0] is previous[0] and torch.equal(out[0], fresh[0])        # same address, new values
    assert out[1] is not fresh[1] and torch.equal(out[1], fresh[1])       # other shape: a copy
    assert out[2] == 7
    kept = task_tensor.clone()
    first = rewritten_in_place([], [task_tensor])          # a tensor get_inputs() holds is never written
    rewritten_in_place(first, [torch.zeros(4, 3)])
    assert first[0] is not task_tensor and torch.equal(task_tensor, kept)


def test_an_output_must_be_laid_out_as_a_caller_expects():
    ref = torch.randn(8, 4)
    expanded = compare_outputs([ref[:1].repeat(8, 1)], [ref[:1].expand(8, 4)], 1e-2, 1e-2)
    assert expanded is not None and "strides [0, 1]" in expanded
    assert compare_outputs([ref.t()], [ref.t()], 1e-2, 1e-2) is None                   # the reference's strides
    assert compare_outputs([ref.t()], [ref.t().contiguous()], 1e-2, 1e-2) is None      # contiguous
    assert compare_outputs([ref[:1].expand(8, 4)], [ref[:1].expand(8, 4)], 1e-2, 1e-2) is None  # as the reference


def test_own_kernels_are_read_from_machine_code():
    """A cubin (nvcc -cubin -arch=sm_90 of tests/fixtures/verifier: two global kernels, a
    template instance, a namespaced and an anonymous-namespace kernel, a __device__ helper that is
    no entry point), and the same cubin embedded in a host library's bytes."""
    cubin = (FIXTURES / "kernels.sm90.cubin").read_bytes()
    names = sorted(qualified_from_mangled(s) for s in entry_symbols(cubin))
    assert names == ["add_kernel", "c_kernel", "foo::nk", "hidden", "tk"]
    blob = b"\x7fELF\x02\x01" + b"host code" * 100 + cubin + b"more host code"
    assert sorted(qualified_from_mangled(s) for s in entry_symbols(blob)) == names
    ptx = b".version 8.0\n.target sm_90\n.visible .entry _Z6kernelPf(\n.param .u64 p\n)\n{\nret;\n}\n"
    assert entry_symbols(ptx) == ["_Z6kernelPf"]
    assert entry_symbols(b"__global__ void spoofed(float* x) {}") == []     # source text names nothing


@pytest.mark.parametrize("profiled, mangled", [
    ("add_kernel(float const*, float*, long)", "_Z10add_kernelPKfPfl"),
    ("void tk<float>(float*)", "_Z2tkIfEvPT_"),
    ("foo::nk(int*)", "_ZN3foo2nkEPi"),
    ("(anonymous namespace)::hidden(int*)", "_ZN36_GLOBAL__N__daa59973_4_k_cu_2f1254c86hiddenEPi"),
    ("c_kernel", "c_kernel"),
])
def test_profiler_and_symbol_names_meet_as_qualified_names(profiled, mangled):
    assert qualified_name(profiled) == qualified_from_mangled(mangled)


def test_outputs_below_atol_cannot_pass_with_garbage():
    """Softmax over 65,536 columns: every value sits far below atol, so 1e-7 * x or a constant
    plus a tiny input-dependent jitter passes allclose; the relative error of the whole output does not."""
    ref = torch.softmax(torch.randn(8, 65536, generator=torch.Generator().manual_seed(0)), -1)
    jitter = torch.full_like(ref, 1 / 65536) + 1e-9 * torch.rand_like(ref)
    for bad in (ref * 1e-7, jitter):
        assert torch.allclose(bad, ref, atol=1e-2, rtol=1e-2)
        assert "relative error" in compare_outputs([ref], [bad], 1e-2, 1e-2)
    honest = (ref.double() * (1 + 1e-4 * torch.randn_like(ref).double())).float()
    assert compare_outputs([ref], [honest], 1e-2, 1e-2) is None
    assert relative_error(torch.zeros(4), torch.zeros(4)) == 0.0


def test_the_precision_rule_by_hand():
    """strict: fp32 allclose at 1e-4 (KernelBench main) and a whole-output relative error of 1e-3,
    atol and rel_l2 raised to 8x the reference's own error against float64 but never above 1e-2;
    fp16 at 1e-2; dice: 1e-2 everywhere."""
    f32, f16 = torch.zeros(3), torch.zeros(3, dtype=torch.float16)
    assert tolerances([f32, f16], [(1e-6, 1e-7), (0.0, 0.0)], "strict") == [[1e-4, 1e-4, 1e-3], [1e-2] * 3]
    assert tolerances([f32], [(1e-4, 2e-4)], "strict") == [[pytest.approx(8e-4), 1e-4, pytest.approx(1.6e-3)]]
    assert tolerances([f32], [(0.5, 0.1)], "strict") == [[1e-2, 1e-4, 1e-2]]        # capped at DICE's
    assert tolerances([f32], None, "strict") == [[1e-4, 1e-4, 1e-3]]                 # no float64 run
    assert tolerances([f32, f16], None, "dice") == [[1e-2] * 3, [1e-2] * 3]
    assert tolerances([f32], None, "strict", atol=0.5) == [[0.5, 1e-4, 1e-3]]        # an explicit option wins
    exact = torch.tensor([1.0, 2.0, float("nan")], dtype=torch.float64)
    assert own_error(exact.float() + torch.tensor([0.0, 1e-3, 0.0]), exact) == pytest.approx((1e-3, 1e-3 / 5 ** 0.5), rel=1e-3)
    with pytest.raises(ValueError, match="precision"):
        VerifyOptions(precision="loose")


def test_strict_precision_accepts_a_sum_of_a_million_floats_into_one_and_refuses_a_tf32_product():
    """The honest MSE control that failed on the H200 at rel_l2 1e-4: a million terms added one by
    one into one float32 (as atomics do) are ~4e-4 off, within KernelBench main's allclose at 1e-4
    and the whole-output 1e-3; a GEMM with TF32-rounded operands fails the elementwise 1e-4."""
    import numpy as np
    x = torch.rand(1 << 20, generator=torch.Generator().manual_seed(0))
    terms = ((x - 0.5) ** 2 / x.numel()).numpy()
    serial = torch.tensor(np.add.accumulate(terms, dtype=np.float32)[-1])   # one addition after another
    ref = torch.mean((x - 0.5) ** 2)
    atol, rtol, rel_l2 = tolerances([ref], [own_error(ref, torch.mean((x.double() - 0.5) ** 2).float())], "strict")[0]
    assert 1e-4 < relative_error(serial.reshape(1), ref.reshape(1)) < rel_l2
    assert compare_outputs([ref], [serial], atol, rtol, rel_l2) is None
    a, b = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)), torch.randn(1024, 256)
    tf32 = lambda t: (t.view(torch.int32) & ~0x1FFF).view(torch.float32)  # noqa: E731 - 10 mantissa bits
    exact = a @ b
    atol, rtol, rel_l2 = tolerances([exact], [(0.0, 0.0)], "strict")[0]
    assert compare_outputs([exact], [tf32(a) @ tf32(b)], atol, rtol, rel_l2) is not None


def test_trial_inputs_are_structured_deterministically_and_stay_in_the_domain():
    g = torch.Generator().manual_seed(1)
    x, idx = torch.rand(64, 128, generator=g) + 0.5, torch.randint(0, 7, (50,), generator=g)
    assert trial_kinds(5) == ["iid", "spiked", "hot", "scaled", "spiked"] and trial_kinds(6)[5] == "iid"
    iid = structured([x, idx], "iid", 3)
    assert torch.equal(iid[0], structured([x, idx], "iid", 3)[0]) and not torch.equal(iid[0], structured([x], "iid", 4)[0])
    ratio = iid[0] / x
    assert ratio.min() >= 1 - JITTER and ratio.max() <= 1 + JITTER
    # integers keep their values in new places, another order each trial (a task drawing them at
    # import cannot be answered by one recorded output)
    assert torch.equal(iid[1].sort().values, idx.sort().values) and not torch.equal(iid[1], idx)
    assert not torch.equal(structured([x, idx], "hot", 3)[1], iid[1])
    hot = structured([x], "hot", 3)[0]
    kept = hot == x
    assert int(kept.sum()) == 1 and torch.allclose(hot[~kept], x[~kept] * HOT_FADE / x.numel())
    scaled = structured([x], "scaled", 3)[0] / x
    spiked = structured([x], "spiked", 3)[0] / x
    assert 0 < int((spiked == SPIKE).sum()) <= x.numel() // SPIKE_EVERY and bool(((spiked == 1) | (spiked == SPIKE)).all())
    assert scaled.unique().numel() == 1 and scaled.flatten()[0].item() in (0.25, 4.0)
    timed = [timed_inputs([x, idx], 9, k) for k in range(3)]
    assert all(torch.equal(t[1].sort().values, idx.sort().values) for t in timed)   # indices permuted, kept
    assert not torch.equal(timed[0][0], timed[1][0])
    permuted = timed_inputs([x, idx], 9, 0, "permuted")   # a task that takes no jitter: values kept, moved
    assert torch.equal(permuted[0].flatten().sort().values, x.flatten().sort().values) and not torch.equal(permuted[0], x)
    assert torch.equal(structured([x], "plain", 3)[0], x)


def test_a_statistic_from_a_subsample_fails_the_hot_and_spiked_trials():
    """From the trials' definitions: a mean over 1/8 of the elements (any pattern) either misses
    the hot element or holds it 8-fold, so it fails on every seed; an MSE offset by 0.5 (the hot
    trial's faded elements then count) sees its Binomial share of the spikes and rarely passes."""
    perm = torch.randperm(1 << 16, generator=torch.Generator().manual_seed(0))
    subsamples = {"stride": lambda v: v[..., ::8], "prefix": lambda v: v[..., : v.shape[-1] // 8],
                  "fixed random": lambda v: v[..., perm[: v.shape[-1] // 8] % v.shape[-1]]}
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        tensors = [torch.rand(1 << 16, generator=g), torch.randn(64, 1024, generator=g), torch.rand(4096, generator=g).half()]
        if seed < 10:    # fp16 past 64 elements: a sparse fade (below its smallest normal)
            tensors.append(torch.rand(1 << 20, generator=g).half())
        for x in tensors:
            hot = structured([x], "hot", seed)[0].float()
            for name, sub in subsamples.items():
                expected, got = hot.mean(-1, keepdim=True), sub(hot).mean(-1, keepdim=True)
                assert compare_outputs([expected], [got], 1e-2, 1e-2) is not None, (seed, name, x.shape, x.dtype)
    passed = 0
    for seed in range(200):
        spiked = structured([torch.rand(1 << 18, generator=torch.Generator().manual_seed(seed))], "spiked", seed)[0]
        d = spiked - 0.5
        passed += compare_outputs([(d * d).mean().reshape(1)], [(d[::8] ** 2).mean().reshape(1)], 1e-2, 1e-2) is None
    assert passed <= 20     # ~3% per spiked trial; two such trials per candidate


def test_fp16_hot_trials_fade_sparsely_where_scaling_would_underflow():
    """2^-8 / 2^20 is far below fp16's smallest normal: a few faded elements at it, the rest zero,
    so the hot element still holds ~256 times the rest of the sum."""
    x = torch.rand(1 << 20, generator=torch.Generator().manual_seed(0)).half()
    hot = structured([x], "hot", 7)[0].float()
    nonzero = int((hot != 0).sum())
    assert 1 < nonzero < 300 and hot.max() > 0.5
    assert hot.max() / (hot.sum() - hot.max()) > 64


def test_the_speedup_interval_narrows_with_agreeing_rounds():
    assert not stable([2.0, 2.0])                             # fewer than MIN_ROUNDS
    assert stable([2.0, 2.01, 1.99]) and not stable([1.5, 2.5, 2.0])
    center, low, high = estimate([2.0, 2.02, 1.98, 2.0])
    assert low < center < high and abs(center - 2.0) < 0.01


@pytest.mark.parametrize("argv, rules", [([], "strict"), (["--rules", "kernelbench"], "kernelbench")])
def test_evaluate_passes_its_kernel_rule_to_the_verifier(tmp_path, fake_verifier, argv, rules):
    """`evaluate.py --rules kernelbench` keeps KernelBench's lax rule for comparing with published
    numbers; the strict rule is the default."""
    import sys

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    import evaluate
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    example = root / "dice" / "assets" / "examples" / "level1_leaky_relu.py"
    (solutions / f"{example.stem}.py").write_text("class ModelNew: pass\n")
    evaluate.main(["--tasks", str(example), "--solutions", str(solutions), "--no-timing", *argv])
    assert fake_verifier.options["rules"] == rules
