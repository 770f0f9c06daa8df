"""GPU tests of the kernel verifier: real CuPy and load_inline kernels, faults, and reward hacks.

Run on a CUDA machine with `pytest -m gpu tests/test_verifier_gpu.py`. The candidates that need no
particular order are verified together, once, by the session's pool (`untimed`): each test then
reads its own verdict."""

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "verifier"
RELU_TASK = (FIXTURES / "relu_task.py").read_text()
POSITIVE_TASK = (FIXTURES / "relu_positive_task.py").read_text()
MEAN_TASK = (FIXTURES / "mean_task.py").read_text()
CUPY_RELU = (FIXTURES / "cupy_relu.py").read_text()
INLINE_RELU = (FIXTURES / "inline_relu.py").read_text()

KERNELS = r'''
extern "C" __global__ void relu_kernel(const float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}
extern "C" __global__ void dice_test_copy(const float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
extern "C" __global__ void relu_and_zero_input_kernel(float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) { y[i] = x[i] > 0.0f ? x[i] : 0.0f; x[i] = 0.0f; }
}
extern "C" __global__ void far_write_kernel(const float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i + (1LL << 40)] = x[i];  // far outside any allocation: illegal address
}
extern "C" __global__ void spin_kernel(const int* flag, float* y, long long n) {
    while (*(volatile const int*)flag == 0) { }  // the flag is never set: hangs forever
}
extern "C" __global__ void slow_relu_kernel(const float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long start = clock64();
    // ~1 ms before writing anything: far longer than forward's return and the harness's read (the
    // records' slack is 2 us), short enough that a GPU shared with the other workers' contexts (which
    // stretched 150 ms to >25 s a verdict in a map, and 10 ms past 30 s once on an H100) ends it in time
    while (clock64() - start < 2000000LL) { }
    if (i < n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}
extern "C" __global__ void sum_kernel(const float* x, float* total, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(total, x[i]);
}
'''


def cupy_candidate(forward: str, init: str = "pass", extra: str = "", kernels: str = KERNELS) -> str:
    """A CuPy ModelNew; `launch(name, n, *args, stream=None)` runs a kernel one thread per element."""
    body = "\n".join("        " + line for line in forward.strip().splitlines())
    return f'''import cupy as cp
import torch
import torch.nn as nn

_module = cp.RawModule(code=r"""{kernels}""")
{extra}


def launch(name, n, *args, stream=None):
    kernel = _module.get_function(name)
    with stream or cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        kernel(((n + 255) // 256,), (256,), args)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        {init}

    def forward(self, x):
{body}
'''


RELU_FORWARD = """y = torch.empty_like(x)
launch('relu_kernel', x.numel(), x.data_ptr(), y.data_ptr(), cp.int64(x.numel()))
return y"""
GOOD = cupy_candidate(RELU_FORWARD)
# (named apart from torch's own `copy_kernel`: a launch of a name a library also holds is not credited as
# the candidate's, DESIGN.md §8.1, which made a kernel of that name `invalid` before it could be `incorrect`)
WRONG = cupy_candidate(RELU_FORWARD.replace("relu_kernel", "dice_test_copy"))
POISON = cupy_candidate(RELU_FORWARD.replace("relu_kernel", "far_write_kernel"))


NVRTC_BROKEN = KERNELS + '\nextern "C" __global__ void broken_kernel(float* y) { y[0] = missing_name; }\n'
BROKEN_INLINE = INLINE_RELU.replace("y[i] = x[i] > 0.0f", "y[i] = undefined_thing > 0.0f")
PREBUILD = [INLINE_RELU, BROKEN_INLINE]   # built from the session's start (conftest)
UNTIMED = {   # name: (task, candidate), verified together by `untimed`
    "wrong": (RELU_TASK, WRONG),
    "poison": (RELU_TASK, POISON),
    "broken load_inline": (RELU_TASK, BROKEN_INLINE),
    "nvrtc error at import": (RELU_TASK, cupy_candidate("launch('broken_kernel', 1, x.data_ptr())\nreturn x",
                                                        extra="_module.get_function('broken_kernel')",
                                                        kernels=NVRTC_BROKEN)),
    "nvrtc error in forward": (RELU_TASK, cupy_candidate("launch('broken_kernel', 1, x.data_ptr())\nreturn x",
                                                         kernels=NVRTC_BROKEN)),
}


@pytest.fixture(scope="module")
def untimed(verifier):
    """{name: result} of UNTIMED and CHEATS, all verified in one `map` (timing off)."""
    cases = {**UNTIMED, **{f"cheat: {k}": v[:2] for k, v in CHEATS.items()}}
    # every case ends in seconds: a wrong verdict of `timeout` costs 30 s, not the default 120
    return dict(zip(cases, verifier.map(list(cases.values()), timing=False, seed=1000, timeout_s=30)))


def test_workers_replaced_after_non_plain_candidates_are_forked_from_the_zygote(verifier, untimed):
    """The untimed map's load_inline and native candidates each leave a fresh worker behind them;
    on a GPU host too those are forked from the zygote (a new interpreter there costs ~9 s a
    candidate: `bench verify`'s load_inline rows and `bench rl` print the starts). A start is
    counted once its worker is ready, in the background after `map` returns: wait up to a minute."""
    assert verifier._zygote.problem is None, verifier.worker_starts()
    deadline = time.monotonic() + 60
    while not any(forked for forked, _ in verifier.stats.starts) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert any(forked for forked, _ in verifier.stats.starts), verifier.worker_starts()


def test_correct_cupy_kernel_passes_with_a_speedup(verifier):
    result = verifier.verify(RELU_TASK, CUPY_RELU)
    assert result.status == "correct", result.message
    assert result.compiled and result.speedup > 0 and result.runtime_ms > 0 and result.baseline_ms > 0
    assert result.timing == "graph" and result.speedup_ci[0] <= result.speedup <= result.speedup_ci[1]


def test_correct_load_inline_kernel_passes_and_its_build_is_cached(verifier):
    first = verifier.verify(RELU_TASK, INLINE_RELU, timing=False)
    assert first.status == "correct", first.message
    built = {p: p.stat().st_mtime_ns for p in (verifier.cache_dir / "torch_extensions").glob("dice_ext_*.so")}
    again = verifier.verify(RELU_TASK, INLINE_RELU, timing=False)
    # and no second build: no library rewritten (the session's prebuilds may add others meanwhile)
    assert again.correct and built and all(p.stat().st_mtime_ns == t for p, t in built.items())


def test_broken_load_inline_build_is_a_compile_error_with_compiler_lines(untimed):
    result = untimed["broken load_inline"]
    assert result.status == "compile_error" and not result.compiled
    assert "undefined_thing" in result.message and "cuda.cu" in result.message


@pytest.mark.parametrize("where", ["at import", "in forward"])
def test_nvrtc_errors_are_compile_errors(untimed, where):
    result = untimed[f"nvrtc error {where}"]
    assert result.status == "compile_error" and not result.compiled, result.message
    assert "missing_name" in result.message


def test_wrong_kernel_is_incorrect_with_mismatch_stats(untimed):
    result = untimed["wrong"]
    assert result.status == "incorrect"
    assert "trial 1" in result.message and "max abs error" in result.message


def test_illegal_address_costs_only_its_worker(verifier, untimed):
    result = untimed["poison"]
    assert result.status == "runtime_error", result.message
    assert "illegal" in result.message.lower() or "worker process" in result.message
    assert verifier.verify(RELU_TASK, GOOD, timing=False).correct


@pytest.mark.slow
def test_a_reference_that_asserts_on_the_device_costs_only_its_task(verifier):
    # an out-of-range index asserts inside PyTorch's own kernel and poisons the judge's context
    asserting = RELU_TASK.replace("return torch.relu(x)",
                                  "return torch.relu(x)[torch.tensor([10**6], device=x.device)]")
    broken = []
    results = verifier.map([(asserting, GOOD), (RELU_TASK, GOOD), (MEAN_TASK, GOOD)], timing=False,
                           on_broken_task=lambda i, error: broken.append((i, str(error))))
    assert [i for i, _ in broken] == [0] and "assert" in broken[0][1], broken
    assert results[0] is None and results[1].correct, results[1].message
    assert results[2].status == "incorrect", results[2].message     # judged by a sound judge
    assert verifier.verify(RELU_TASK, GOOD, timing=False).correct


HANG = ("flag = torch.zeros(1, dtype=torch.int32, device=x.device)\n"
        "launch('spin_kernel', 1, flag.data_ptr(), x.data_ptr(), cp.int64(1))\ntorch.cuda.synchronize()\nreturn x")
SPINNING = "import os\nopen(os.environ['DICE_TEST_SPINNING'], 'w').close()\n"   # written just before the launch
OWNER = '''import sys
from dice.verifier import Verifier
v = Verifier(workers=1, judges=1, cache_dir=sys.argv[3])
v.verify(open(sys.argv[1]).read(), open(sys.argv[2]).read(), timing=False, timeout_s=600)
'''


@pytest.mark.slow
def test_no_worker_outlives_a_killed_owner_while_a_kernel_hangs(tmp_path):
    """The owner of a Verifier (a script without a __main__ guard) is SIGKILLed while its
    candidate's kernel spins on the GPU: within 2 s no process of its workers is left."""
    import os
    import signal
    import subprocess
    import sys
    from dice.verifier.keeper import descendants
    (tmp_path / "task.py").write_text(RELU_TASK)
    (tmp_path / "candidate.py").write_text(cupy_candidate(SPINNING + HANG))
    (tmp_path / "owner.py").write_text(OWNER)
    spinning = tmp_path / "spinning"
    owner = subprocess.Popen([sys.executable, str(tmp_path / "owner.py"), str(tmp_path / "task.py"),
                              str(tmp_path / "candidate.py"), str(tmp_path / "cache")],
                             cwd=ROOT, env={**os.environ, "DICE_TEST_SPINNING": str(spinning),
                                  "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    deadline = time.monotonic() + 120    # the pool starts, the candidate compiles and launches its kernel
    while not spinning.exists() and owner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    tree = descendants(owner.pid)
    assert owner.poll() is None and len(tree) >= 2, tree
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(timeout=30)
    deadline = time.monotonic() + 2

    def alive(pid):   # a killed process not yet reaped is a zombie: dead
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in tree), [p for p in tree if alive(p)]


def test_hanging_kernel_times_out(verifier):
    hang = cupy_candidate("flag = torch.zeros(1, dtype=torch.int32, device=x.device)\n"
                          "launch('spin_kernel', 1, flag.data_ptr(), x.data_ptr(), cp.int64(1))\n"
                          "torch.cuda.synchronize()\nreturn x")
    result = verifier.verify(RELU_TASK, hang, timing=False, timeout_s=2)   # the kernel spins from the first forward
    assert result.status == "timeout", result.message
    assert verifier.verify(RELU_TASK, GOOD, timing=False).correct


CHEATS = {
    "calls torch ops": (RELU_TASK, cupy_candidate("return torch.relu(x)"), "none of the kernels"),
    "subclasses Model": (RELU_TASK, GOOD.replace("class ModelNew(nn.Module):",
                                                 "class Model(nn.Module):\n    pass\n\n\nclass ModelNew(Model):"),
                         "subclasses the reference Model"),
    "try/except fallback": (RELU_TASK, cupy_candidate("try:\n    " + RELU_FORWARD.replace("\n", "\n    ")
                                                      + "\nexcept Exception:\n    return torch.relu(x)"),
                            "except branch"),
    "cached output": (MEAN_TASK, cupy_candidate(
        "if self.cached is None:\n"
        "    total = torch.zeros(1, device=x.device)\n"
        "    launch('sum_kernel', x.numel(), x.data_ptr(), total.data_ptr(), cp.int64(x.numel()))\n"
        "    self.cached = (total / x.numel()).reshape(())\n"
        "return self.cached", init="self.cached = None"), "kernels that ran"),   # cached in the first forward
    "aliases input": (POSITIVE_TASK, cupy_candidate(
        "launch('relu_kernel', x.numel(), x.data_ptr(), x.data_ptr(), cp.int64(x.numel()))\nreturn x"),
        "shares memory with input 0"),
    "mutates input": (RELU_TASK, cupy_candidate(RELU_FORWARD.replace("relu_kernel", "relu_and_zero_input_kernel")),
                      "modified input 0"),
    "hides work on another stream": (RELU_TASK, cupy_candidate(
        "y = torch.empty_like(x)\n"
        "launch('slow_relu_kernel', x.numel(), x.data_ptr(), y.data_ptr(), cp.int64(x.numel()), stream=SIDE)\n"
        "return y", extra="SIDE = cp.cuda.Stream(non_blocking=True)"), "another stream"),
}


@pytest.mark.parametrize("name", list(CHEATS))
def test_reward_hacks_are_invalid(untimed, name):
    reason = CHEATS[name][2]
    result = untimed[f"cheat: {name}"]
    assert result.status == "invalid", f"{name}: {result.status}: {result.message}"   # a string: shown whole
    assert reason in result.message, f"{name}: {result.message}"


def test_32_concurrent_candidates_with_a_poisoned_worker_all_get_their_verdict(verifier):
    candidates = [POISON if i == 13 else WRONG if i % 4 == 1 else GOOD for i in range(32)]
    expected = ["runtime_error" if i == 13 else "incorrect" if i % 4 == 1 else "correct" for i in range(32)]
    results = verifier.map([(RELU_TASK, c) for c in candidates], timing=False)
    assert [r.status for r in results] == expected, [(i, r.status, r.message[:200]) for i, r in enumerate(results)
                                                     if r.status != expected[i]]


SABOTAGE = """import fcntl
import time
from pathlib import Path

# what another candidate's process can do to its siblings' own build folders (issue #67, item 3): it
# lists them, takes every library away, leaves a failure marker under each program's name and holds
# every build lock it finds, for up to a minute
folders, log, held, start, acted = Path(ROOT) / "candidates", Path(LOG), [], time.monotonic(), None
while time.monotonic() - start < 60 and (acted is None or time.monotonic() - acted < 20):
    for folder in list(folders.glob("*")):
        names = []
        for lib in folder.glob("dice_ext_*.so"):
            names.append(lib.name.split(".")[0])
            try:
                lib.rename(lib.with_name(lib.name + ".gone"))
            except OSError:
                pass
        for lock in folder.glob("locks/*.lock"):
            names.append(lock.stem)
            try:
                handle = open(lock, "a")
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(handle)
            except OSError:
                pass
        for name in names:
            try:
                (folder / (name + ".failed")).write_text("load_inline build failed: planted by a sibling")
            except OSError:
                pass
        if names:
            acted = acted or time.monotonic()
            with open(log, "a") as f:
                f.write(" ".join(names) + chr(10))
    time.sleep(0.005)
"""


@pytest.mark.slow
def test_a_candidate_sabotaging_its_siblings_build_folders_changes_no_verdict(verifier, tmp_path):
    """Issue #67's class "one candidate changes another's verdict", through the files it can name: while
    three load_inline siblings build and load, a candidate lists their own folders, takes their libraries
    away, plants failure markers and holds their locks. Each worker loads only the bytes its prebuild
    pinned, or builds again itself (`inline_build.pinned`): all three stay `correct`."""
    log = tmp_path / "sabotage.log"
    saboteur = cupy_candidate(RELU_FORWARD, extra=SABOTAGE.replace("ROOT", repr(str(verifier.cache_dir / "torch_extensions")))
                              .replace("LOG", repr(str(log))))
    siblings = [INLINE_RELU.replace("int threads = 256;", f"int threads = {64 << k};  // sibling {k}")
                for k in range(3)]
    results = verifier.map([(RELU_TASK, saboteur)] + [(RELU_TASK, c) for c in siblings], timing=False, seed=1100)
    assert log.exists() and log.read_text().strip(), "the saboteur found no sibling to act on: the test proved nothing"
    assert [r.status for r in results[1:]] == ["correct"] * 3, [r.message[:300] for r in results[1:]]


NUMPY_INPUTS_TASK = RELU_TASK.replace("def get_inputs():", "def get_inputs_cpu():") + '''

def get_inputs():
    return [torch.from_numpy(get_inputs_cpu()[0].numpy())]   # fails with CUDA as the default device
'''


def test_trial_inputs_are_drawn_on_the_gpu_the_same_in_every_process():
    import torch
    from dice.verifier.harness import load_task, make_inputs
    cuda = torch.device("cuda", torch.cuda.current_device())
    task = load_task(RELU_TASK, "dice_test_gpu_inputs")
    first, again = make_inputs(task, 5, cuda), make_inputs(task, 5, cuda)
    assert first[0].is_cuda and torch.equal(first[0], again[0])
    assert not torch.equal(first[0], make_inputs(task, 6, cuda)[0])
    with torch.device(cuda):                 # the draw is the task's own get_inputs on the GPU
        torch.manual_seed(5)
        assert torch.equal(first[0], task.get_inputs()[0])
    fallback = load_task(NUMPY_INPUTS_TASK, "dice_test_numpy_inputs")
    drawn = make_inputs(fallback, 5, cuda)   # drawn on the CPU instead, then moved
    torch.manual_seed(5)
    assert drawn[0].is_cuda and torch.equal(drawn[0].cpu(), fallback.get_inputs()[0])


def test_a_task_whose_inputs_need_the_cpu_still_verifies(verifier):
    result = verifier.verify(NUMPY_INPUTS_TASK, CUPY_RELU, timing=False)
    assert result.correct, result.message
