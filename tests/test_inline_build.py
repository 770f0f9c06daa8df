"""The fast load_inline build on the CPU: torch's generated files, the device/host split (what it
accepts, what it refuses, the launch shims), cache keys, torch's flags, the fallback to torch's
build, and (slow: nvcc and g++ here) compiling split programs and a BuildPool prebuild."""
import fcntl
import hashlib
import hmac
import inspect
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

from dice.bench.build_cost import CPU_ONLY_LIBRARIES
from dice.tasks.prompts import EXAMPLE_LOAD_INLINE
from dice.verifier.inline_build import cache as build_module
from dice.verifier.inline_build.cache import BuildCache, BuildError
from dice.verifier.inline_build.cxx import normalise
from dice.verifier.inline_build.fast import CompiledUnits, FastBuildFailed, SharedCompileError
from dice.verifier.inline_build.toolchain import (CompilerSlots, Flags, dispatcher, lazy_names, namespace_scope_names,
                                          precompiled_header)
from dice.verifier.inline_build.inline import Unsplittable, split_program
from dice.verifier.inline_build.torch_inline import cuda_cu, main_cpp, recorded_calls

from conftest import Occupancy, run_in_threads

HAVE_NVCC = Path("/usr/local/cuda/bin/nvcc").exists() and shutil.which("c++") is not None
HEADER = "#include <torch/extension.h>\n"
MANY = HEADER + r'''
#include <cuda_runtime.h>
#define BLOCK 256
#define CHECK_INPUT(x) TORCH_CHECK(x.is_cuda(), #x " must be a CUDA tensor")
constexpr int WARP = 32;
struct Scale { float a, b; };

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_down_sync(0xffffffff, v, o);
    return v;
}

__global__ void affine(const float* __restrict__ x, float* y, Scale s, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = s.a * x[i] + s.b;
}

__global__ void total(const float* x, float* out, int n) {
    extern __shared__ float buf[];
    float v = threadIdx.x < n ? x[threadIdx.x] : 0.0f;
    v = warp_sum(v);
    if (threadIdx.x % WARP == 0) atomicAdd(out, v);
}

torch::Tensor run(torch::Tensor x, double a, double b) {
    CHECK_INPUT(x);
    auto y = torch::empty_like(x);
    auto out = torch::zeros({1}, x.options());
    int64_t n = x.numel();
    affine<<<(n + BLOCK - 1) / BLOCK, BLOCK>>>(x.data_ptr<float>(), y.data_ptr<float>(), Scale{(float)a, (float)b}, n);
    total<<<1, BLOCK, BLOCK * sizeof(float)>>>(y.data_ptr<float>(), out.data_ptr<float>(), (int)n);
    cudaStream_t stream = nullptr;
    total<<<dim3(1), dim3(BLOCK), 0, stream>>>(y.data_ptr<float>(), out.data_ptr<float>(), 1);
    return out;
}
'''
CPP = "torch::Tensor run(torch::Tensor x, double a, double b);"


def split(cuda: str, cpp: str = CPP, functions=("run",)) -> object:
    functions = functions if isinstance(functions, dict) else list(functions)
    return split_program([cpp], [cuda], functions, True, "/build/cuda.cu")


def refused(cuda: str, cpp: str = CPP, functions=("run",)) -> str:
    with pytest.raises(Unsplittable) as info:
        split(cuda, cpp, functions)
    return info.value.reason


def test_generated_files_are_torchs(tmp_path, monkeypatch):
    """main.cpp and cuda.cu as torch's load_inline writes them (list and dict functions)."""
    def stop(*args, **kwargs):
        raise StopIteration
    monkeypatch.setattr(cpp_extension, "_jit_compile", stop)
    for functions, handling in ((["run"], True), ({"run": "Run it.", "other": "two"}, True), (["run"], False)):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        with pytest.raises(StopIteration):
            cpp_extension.load_inline("x", [CPP], cuda_sources=[MANY], functions=functions, build_directory=str(folder),
                                      with_pytorch_error_handling=handling)
        assert (folder / "main.cpp").read_text() == main_cpp([CPP], functions, handling)
        assert (folder / "cuda.cu").read_text() == cuda_cu([MANY])


def test_example_splits():
    call = recorded_calls(EXAMPLE_LOAD_INLINE)[0]
    s = split_program([call["cpp_sources"]], [call["cuda_sources"]], call["functions"], True, "/b/cuda.cu")
    assert s.host.startswith(main_cpp([call["cpp_sources"]], call["functions"]) + "\n")
    assert "__dice_config_add_kernel(blocks, threads)(a.data_ptr<float>()" in s.host
    assert "<<<" not in s.host and "__global__" not in s.host
    assert "add_kernel<<<__dice_g, __dice_b, __dice_s, __dice_t>>>(a, b, out, n)" in s.device
    assert "torch" not in s.device.replace("torch/extension.h", "") and "empty_like" not in s.device
    assert s.kernels == ["add_kernel"]


def test_split_keeps_line_numbers():
    s = split(MANY)
    device_lines = s.device.split('#line 4 "/build/cuda.cu"\n', 1)[1].splitlines()
    host_lines = s.host.split('#line 4 "/build/cuda.cu"\n', 1)[1].splitlines()
    source = MANY.splitlines()
    assert len(device_lines) == len(host_lines) == len(source)
    at = next(i for i, line in enumerate(source) if "atomicAdd" in line)
    assert device_lines[at] == source[at] and host_lines[at] == ""


def test_many_kernels_macros_structs_and_launches():
    s = split(MANY)
    assert s.kernels == ["affine", "total"]
    assert "__dice_config_affine((n + BLOCK - 1) / BLOCK, BLOCK)(x.data_ptr<float>()" in s.host
    assert "__dice_config_total(1, BLOCK, BLOCK * sizeof(float))(" in s.host
    assert "__dice_config_total(dim3(1), dim3(BLOCK), 0, stream)(" in s.host
    assert "struct Scale { float a, b; };" in s.device and "struct Scale { float a, b; };" in s.host
    assert "constexpr int WARP = 32;" in s.device and "#define BLOCK 256" in s.device
    assert "warp_sum" not in s.host and "torch::empty_like" not in s.device


def test_shim_declarations():
    s = split(MANY)
    assert ("void __dice_launch_affine(dim3, dim3, size_t, cudaStream_t, const float * __restrict__ x, float * y, "
            "Scale s, int64_t n); struct __dice_call_affine { dim3 __dice_g, __dice_b; size_t __dice_s; "
            "cudaStream_t __dice_t; void operator()(const float * __restrict__ x, float * y, Scale s, int64_t n) const "
            "{ __dice_launch_affine(__dice_g, __dice_b, __dice_s, __dice_t, x, y, s, n); } }; inline __dice_call_affine "
            "__dice_config_affine(dim3 __dice_g, dim3 __dice_b, size_t __dice_s = 0, cudaStream_t __dice_t = 0) "
            "{ return {__dice_g, __dice_b, __dice_s, __dice_t}; }") in s.host
    assert ("void __dice_launch_affine(dim3 __dice_g, dim3 __dice_b, size_t __dice_s, cudaStream_t __dice_t, "
            "const float * __restrict__ x, float * y, Scale s, int64_t n) { affine<<<__dice_g, __dice_b, __dice_s, "
            "__dice_t>>>(x, y, s, n); }") in s.device


def test_dict_functions_and_prototype_kernels():
    cuda = HEADER + "__global__ void k(float* y);\nvoid go(torch::Tensor y) { k<<<1, 1>>>(y.data_ptr<float>()); }\n" \
        "__global__ void k(float* y) { y[0] = 1.0f; }\n"
    s = split(cuda, "void go(torch::Tensor y);", {"go": "Set y[0] to one."})
    assert 'm.def("go", torch::wrap_pybind_function(go), "Set y[0] to one.");' in s.host
    assert s.host.count("struct __dice_call_k") == 1 and s.device.count("void __dice_launch_k(") == 1


def test_shared_errors_are_names_declared_nowhere():
    """Hand-made compiler lines: an undeclared name torch's headers and the program do not
    declare is torch's error too; one they declare, and our own shims' names, are not."""
    from dice.verifier.inline_build.fast import shared_error
    names, declared = frozenset({"min", "Tensor"}), frozenset({"helper"})
    assert shared_error('cuda.cu(9): error: identifier "idx2" is undefined', names, declared)
    assert shared_error("main.cpp:2:1: error: \u2018Tensr\u2019 in namespace \u2018torch\u2019 does not name a type",
                        names, declared)
    for line in ("main.cpp:5:9: error: 'min' was not declared in this scope",
                 'cuda.cu(3): error: identifier "helper" is undefined', "error: 'x' has incomplete type",
                 'cuda.cu(4): error: identifier "__dice_config_k" is undefined'):
        assert shared_error(line, names, declared) is None, line


def test_names_in_an_initializer_are_used_not_declared():
    """`= name` only uses name: a program whose initializer names an undeclared identifier has a
    compile error torch's build shares (a verdict, not a torch rebuild)."""
    from dice.verifier.inline_build.cxx import items, tokenize
    source = ("__device__ int flag = undeclared_name;\n__device__ float table[2] = {0.f, other};\n"
              "constexpr int N = 4, M = N + K;\nint plain;\nusing Alias = float;\n")
    declared = set().union(*(item.declared for item in items(tokenize(source))))
    assert declared == {"flag", "table", "N", "M", "plain", "Alias"}


def test_generic_binding_unit():
    """The dispatch host unit: cpp_sources on dispatch.h, no torch/extension.h anywhere, one entry
    per function with torch's error handling as asked; a function cpp_sources does not declare
    (torch's main.cpp would not compile) or a name that is not an identifier is refused."""
    s = split_program([CPP], [MANY], ["run"], False, "/build/cuda.cu", binding="dispatch")
    assert s.binding == "dispatch" and s.main_lines == 0 and "torch/extension.h" not in s.host
    assert s.host.startswith('#include "') and s.host.splitlines()[0].endswith('dispatch.h"')
    assert s.host.count("\n") > MANY.count("\n") and "PYBIND11_MODULE" not in s.host
    assert "DICE_ENTRY(run, 0)" in s.host.splitlines()[-1] and "*__dice_count = 1" in s.host
    with pytest.raises(Unsplittable, match="does not declare run"):
        split_program(["torch::Tensor other(torch::Tensor x);"], [MANY], ["run"], True, "/b/cuda.cu", binding="dispatch")
    with pytest.raises(Unsplittable, match="plain identifiers"):
        split_program([CPP], [MANY], {"run(x)": "doc"}, True, "/b/cuda.cu", binding="dispatch")


@pytest.mark.parametrize("cuda, reason", [
    ("template <typename T> __global__ void k(T* y) { y[0] = 1; }\n", "templated kernel"),
    ("__constant__ float c[4];\n__global__ void k(float* y) { y[0] = c[0]; }\n"
     "void run2(torch::Tensor w) { cudaMemcpyToSymbol(c, w.data_ptr<float>(), 16); }\n", "device symbol used by host code"),
    ("__global__ void k(float* y) { y[0] = 1; }\nvoid run2() { cudaFuncSetAttribute(k, "
     "cudaFuncAttributeMaxDynamicSharedMemorySize, 1 << 16); }\n", "kernel used outside a <<<>>> launch"),
    ("__global__ void k(at::Half* y) { }\n", "device code uses torch/ATen/c10"),
    ("__device__ float f(c10::Half h) { return h; }\n", "device code uses torch/ATen/c10"),
    ("__global__ void k(float* y) { y[0] = torch::kFloat32; }\n", "device code uses torch/ATen/c10"),
    ("#ifdef FAST\n#define N 4\n#endif\n", "preprocessor conditional or directive at file scope"),
    ("namespace { __global__ void k(float* y) {} }\n", "namespace or extern block"),
    ("void run2(float* y) {\n#ifdef __CUDACC__\n y[0] = 1;\n#endif\n}\n", "CUDA device code in host code"),
    ("__global__ void k(float*) {}\n", "kernel parameters"),
    ("#define GO(y) k<<<1, 1>>>(y)\n", "launch inside a macro"),
    ("template <int N> __global__ void k(float* y) {}\nvoid run2(float* y) { k<4><<<1, 1>>>(y); }\n",
     "templated kernel"),
])
def test_refusals(cuda, reason):
    assert refused(HEADER + cuda) == reason


def test_refusals_of_cpp_sources_and_order():
    assert refused(MANY, CPP + "\nint helper() { return 1; }") == "cpp_sources not only declarations"
    assert refused(MANY, "torch::Tensor run(torch::Tensor x, double a, double b = 1.0);") == \
        "cpp_sources not only declarations"
    assert refused(MANY, "#define X 1\n" + CPP) == "cpp_sources not only declarations"
    early = HEADER + "torch::Tensor g(torch::Tensor x) { return run(x, 1, 0); }\n" + MANY.replace(HEADER, "")
    assert refused(early) == "cpp_sources declares a function cuda_sources uses before declaring it"
    assert refused(MANY.replace(HEADER, "") + HEADER) == "host code before #include <torch/extension.h>"
    assert refused(MANY, "#include <vector>\n" + CPP) == "cpp_sources includes a header cuda_sources does not"
    assert refused(MANY.replace("blockDim.x", "blockDim.x + __dice")) == "reserved names"


def test_torch_macros_in_device_code():
    cuda = HEADER + "__global__ void k(float* y) { y[0] = CUDA_KERNEL_ASSERT(1); }\n"
    with pytest.raises(Unsplittable, match="CUDA_KERNEL_ASSERT"):
        split_program([CPP], [cuda], ["run"], True, "/b/cuda.cu", frozenset({"CUDA_KERNEL_ASSERT"}))
    own = HEADER + "#define CHECK(x) x\n__global__ void k(float* y) { y[0] = CHECK(1); }\n"
    split_program([CPP], [own], ["run"], True, "/b/cuda.cu", frozenset({"CHECK"}))   # the program's own macro


def test_namespace_scope_names():
    """What a declaration outside every body and parenthesis introduces; never a parameter, a local
    or a member (hand-written preprocessed C++)."""
    code = """# 1 "x.h" 3
namespace nv { namespace detail { struct half_t { float inner; }; } }
extern "C" { int c_fn(int c_param); }
enum mode { MODE_A = 1, MODE_B };
typedef struct half_s { int member; } alias_t;
static inline float to_f(const int h) { float local = 1.0f; return local; }
template <typename Tp> Tp pick(Tp a_param) { return a_param; }
const char* text = "a { brace in a string";
"""
    names = namespace_scope_names(code)
    assert {"nv", "detail", "half_t", "c_fn", "mode", "MODE_A", "MODE_B", "half_s", "alias_t", "to_f", "pick",
            "text"} <= names
    assert not names & {"inner", "c_param", "member", "h", "local", "a_param", "brace", "x"}


HALVES = frozenset({"__half", "half", "__float2half", "__half2float"})
USES_HALF = MANY.replace("y[i] = s.a * x[i] + s.b;", "y[i] = __half2float(__float2half(s.a * x[i] + s.b));")


def test_a_device_unit_naming_no_half_precision_name_leaves_the_half_headers_out():
    lean = split_program([CPP], [MANY], ["run"], True, "/build/cuda.cu", lazy_names=HALVES)
    full = split(MANY)    # lazy_names None: the headers always
    assert "#include <cuda_fp16.h>" in full.device and "#include <cuda_bf16.h>" in full.device
    assert full.device_full == ""
    assert "cuda_fp16.h" not in lean.device and "cuda_bf16.h" not in lean.device and lean.device_full == full.device
    assert lean.device.split("#line")[1] == full.device.split("#line")[1]   # the program's lines, numbered alike
    assert lean.host == full.host
    named = split_program([CPP], [USES_HALF], ["run"], True, "/build/cuda.cu", lazy_names=HALVES)
    assert "#include <cuda_fp16.h>" in named.device and named.device_full == ""


def test_normalise():
    a = "int  f(int x) {\n  // add one\n  return x + 1; /* done */\n}\n"
    assert normalise(a) == normalise("int f(int x) {\n\n\n  return x + 1;\n}")
    assert normalise(a) != normalise(a.replace("x + 1", "x + 2"))
    assert normalise('printf("a  b");') != normalise('printf("a b");')
    assert normalise("#define F(x) x\nF(1)") != normalise("#define F (x) x\nF(1)")
    assert normalise("#define A 1 /* c\n */ + 2\nA") == normalise("#define A 1 + 2\nA")


def test_cache_key(tmp_path):
    cache = BuildCache(tmp_path, capability=(9, 0), build="torch")
    base = dict(name="a", cpp_sources=CPP, cuda_sources=MANY, functions=["run"])
    name = cache.name(cache.arguments(**base))
    assert cache.name(cache.arguments(**{**base, "name": "b", "cuda_sources": "// v2\n" + MANY})) == name
    assert cache.name(cache.arguments(**{**base, "cuda_sources": MANY.replace("BLOCK 256", "BLOCK 128")})) != name
    assert cache.name(cache.arguments(**{**base, "extra_cuda_cflags": ["-O3"]})) != name
    other_gpu = BuildCache(tmp_path, capability=(8, 0), build="torch")
    assert other_gpu.name(other_gpu.arguments(**base)) != name


@pytest.fixture
def cuda_home(monkeypatch):
    """torch's CUDA_HOME, which the CPU wheel leaves unset, pointed at the local toolkit."""
    if not HAVE_NVCC:
        pytest.skip("needs nvcc and g++")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)


def test_flags_are_torchs_but_one_architecture(cuda_home):
    arguments = {"extra_cflags": None, "extra_cuda_cflags": ["-O3", "--use_fast_math", "-U__CUDA_NO_HALF_OPERATORS__"],
                 "extra_ldflags": ["-lcublas"], "extra_include_paths": None}
    flags = Flags(arguments, "ext", (9, 0))
    assert "-gencode=arch=compute_90,code=sm_90" in flags.device() and not any("code=compute" in f for f in flags.device())
    assert "-DTORCH_EXTENSION_NAME=ext" in flags.host() and "-DTORCH_EXTENSION_NAME=ext" not in flags.pch()
    assert flags.host_defines[:1] == ["#define __CUDA_NO_HALF_OPERATORS__ 1"]
    assert flags.host_defines[-1] == "#undef __CUDA_NO_HALF_OPERATORS__"
    assert flags.ldflags[:2] == ["-shared", "-lcublas"] and "-ltorch_python" in flags.ldflags
    for bad in (["-Xcompiler", "-fopenmp"], ["-DNDEBUG"], ["-I/opt/x"], ["-O3 $(HOME)"]):
        with pytest.raises(Unsplittable):
            Flags({**arguments, "extra_cuda_cflags": bad}, "ext", (9, 0))
    with pytest.raises(Unsplittable):
        Flags({**arguments, "extra_cflags": ["-std=c++14"]}, "ext", (9, 0))


def test_compiler_slots_bound_concurrency(tmp_path):
    slots, occupancy = CompilerSlots(tmp_path, 2), Occupancy()

    def work():
        with slots.hold():
            occupancy.occupy(0.1)

    run_in_threads([work] * 6)
    assert occupancy.most == 2


FAKE_COMPILER = """#!/usr/bin/env python3
import sys
if sys.argv[1:] == ["--version"]:
    print("fakecc 1.0")
    sys.exit(0)
source, target = sys.argv[sys.argv.index("-c") + 1], sys.argv[sys.argv.index("-o") + 1]
text = open(source).read()
with open(sys.argv[0] + ".runs", "a") as runs:
    runs.write(source + "\\n")
if "slow" in text:
    import time
    time.sleep(0.5)
if "error" in text:
    print(source + ":1: error: bad unit")
    sys.exit(1)
print("warning: compiled " + source)
open(target, "w").write("object of " + text)
"""


def test_a_unit_compiled_before_is_copied_not_compiled(tmp_path):
    cc = tmp_path / "fakecc"
    cc.write_text(FAKE_COMPILER)
    cc.chmod(0o755)
    slots = CompilerSlots(tmp_path / "cache")

    def compile_in(build: str, text: str):
        folder = tmp_path / build
        folder.mkdir()
        (folder / "cuda.cu").write_text(text.replace("FOLDER", str(folder)))
        argv = [str(cc), "-O3", f"-DTORCH_EXTENSION_NAME=ext_{build}", "-c", str(folder / "cuda.cu"), "-o",
                str(folder / "cuda.o")]
        status, _ = CompiledUnits(tmp_path / "cache", folder).compile(argv, [str(cc)], folder / "device.log", slots)
        return status, folder

    def runs() -> int:
        return len((tmp_path / "fakecc.runs").read_text().splitlines())

    status, first = compile_in("a", "kernel one")
    assert status == 0 and runs() == 1
    status, second = compile_in("b", "kernel one")          # the same unit in another program's folder
    assert status == 0 and runs() == 1
    assert (second / "cuda.o").read_text() == "object of kernel one"
    # its warnings too, naming the folder of the build that copies it
    assert (second / "device.log").read_text() == (first / "device.log").read_text().replace(str(first), str(second))
    assert compile_in("c", "kernel two")[0] == 0 and runs() == 2
    for build in ("d", "e"):                                  # a failure is compiled again each time
        status, folder = compile_in(build, "an error")
        assert status == 1 and "bad unit" in (folder / "device.log").read_text()
    assert runs() == 4
    assert compile_in("f", "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)")[0] == 0 and runs() == 5
    assert compile_in("g", "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)")[0] == 0 and runs() == 6   # names its module
    # a unit that names its own folder (the split's #line directives) is the same unit in every folder
    assert compile_in("h", '#line 4 "FOLDER/cuda.cu"\nhost')[0] == 0 and runs() == 7
    status, folder = compile_in("i", '#line 4 "FOLDER/cuda.cu"\nhost')
    assert status == 0 and runs() == 7 and str(folder / "cuda.cu") in (folder / "device.log").read_text()


def test_a_unit_built_by_several_programs_at_once_is_compiled_once(tmp_path):
    """An RL group's programs build together: the first compiles the shared unit, the rest copy it."""
    cc = tmp_path / "fakecc"
    cc.write_text(FAKE_COMPILER)
    cc.chmod(0o755)
    slots = CompilerSlots(tmp_path / "cache", 8)

    def compile_in(build: str) -> tuple[int, str]:
        folder = tmp_path / build
        folder.mkdir()
        (folder / "main.cpp").write_text("slow host unit")
        argv = [str(cc), "-c", str(folder / "main.cpp"), "-o", str(folder / "main.o")]
        status, _ = CompiledUnits(tmp_path / "cache", folder).compile(argv, [str(cc)], folder / "host.log", slots)
        return status, (folder / "main.o").read_text()

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(compile_in, [f"program-{i}" for i in range(6)]))
    assert results == [(0, "object of slow host unit")] * 6
    assert len((tmp_path / "fakecc.runs").read_text().splitlines()) == 1


def test_a_failed_toolchain_artifact_is_tried_again_later_not_for_ever(tmp_path, monkeypatch):
    from dice.verifier.inline_build import toolchain
    tries = []

    def make(folder: Path) -> bool:
        tries.append(folder)
        (folder / "made").write_text("x")
        return len(tries) > 1          # the first try fails

    assert toolchain._locked_artifact(tmp_path, "key", make) is None
    assert toolchain._locked_artifact(tmp_path, "key", make) is None and len(tries) == 1   # remembered
    old = time.time() - toolchain.RETRY_FAILED_S - 1
    os.utime(tmp_path / "key", (old, old))                                                  # ... for a while
    made = toolchain._locked_artifact(tmp_path, "key", make)
    assert made == tmp_path / "key" and (made / "made").exists() and len(tries) == 2
    assert toolchain._locked_artifact(tmp_path, "key", make) == made and len(tries) == 2    # kept for good


def test_torch_macros_are_read_in_a_process_without_stdin(tmp_path, cuda_home):
    """The prebuild children ran with fd 0 closed, where nvcc fails ("Failed to preprocess host
    compiler properties") and every build then took torch's ~60 s way."""
    script = (f"import os, torch.utils.cpp_extension as ce\nce.CUDA_HOME = '/usr/local/cuda'\nos.close(0)\n"
              f"from pathlib import Path\nfrom dice.verifier.inline_build.toolchain import Flags, torch_macros\n"
              f"flags = Flags(dict.fromkeys(['extra_cflags', 'extra_cuda_cflags', 'extra_ldflags', "
              f"'extra_include_paths']), 'ext', (9, 0))\nprint(len(torch_macros(Path({str(tmp_path)!r}), flags)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and int(done.stdout.split()[-1]) > 100, done.stderr[-2000:]


class _FakeTorchBuild:
    """torch's load_inline standing in for a real build: writes a file named like the library."""

    def __init__(self):
        self.calls = 0
        self.__signature__ = inspect.signature(cpp_extension.load_inline)   # BuildCache binds by it

    def __call__(self, **arguments):
        self.calls += 1
        Path(arguments["build_directory"]).mkdir(parents=True, exist_ok=True)
        (Path(arguments["build_directory"]) / f"{arguments['name']}.so").write_bytes(b"")
        return "module"


@pytest.mark.slow
def test_fallback_to_torch(tmp_path, monkeypatch, cuda_home):
    cache = BuildCache(tmp_path, capability=(9, 0), build="fast")
    cache.real_load_inline = fake = _FakeTorchBuild()
    templated = HEADER + "template <typename T> __global__ void k(T* y) {}\n"
    assert cache.load_inline("x", CPP, cuda_sources=templated, functions=["run"]) == "module"
    assert fake.calls == 1 and cache.history[-1]["how"] == "torch"
    assert cache.history[-1]["reason"].startswith("split refused: templated kernel")

    def failing(*args, **kwargs):
        raise FastBuildFailed("nvcc: error")
    monkeypatch.setattr(build_module, "fast_build", failing)
    assert cache.load_inline("x", CPP, cuda_sources=MANY, functions=["run"]) == "module"
    assert fake.calls == 2 and cache.history[-1]["reason"] == "fast build failed: nvcc: error"

    def main_cpp_error(*args, **kwargs):
        raise SharedCompileError(f"{tmp_path}/main.cpp:2:1: error: 'Tensr' does not name a type")
    monkeypatch.setattr(build_module, "fast_build", main_cpp_error)
    with pytest.raises(BuildError, match="does not name a type"):
        cache.load_inline("x", "Tensr f();", cuda_sources=MANY, functions=["f"])
    assert fake.calls == 2   # torch's main.cpp is that text: no rebuild


def test_a_cached_library_that_does_not_import_is_built_again_by_torch(tmp_path):
    """`build_only` places what it built without importing it, so a cached `<name>.so` or
    `<name>.dispatch.so` may not import: `load_inline` removes it and builds the program again with
    torch's build (which imports what it built), once; the next load uses the new library."""
    for suffix in (".so", ".dispatch.so"):
        cache = BuildCache(tmp_path / suffix.strip("."), capability=(9, 0), build="torch")
        cache.real_load_inline = fake = _FakeTorchBuild()
        call = dict(name="x", cpp_sources=CPP, cuda_sources=MANY, functions=["run"])
        name = cache.name(cache.arguments(**call))
        broken = cache.programs / f"{name}{suffix}"
        broken.write_bytes(b"not an ELF file")
        if suffix == ".dispatch.so":
            Path(f"{broken}.dispatcher").write_text(str(broken))   # not a trusted dispatcher: one that fails
        assert cache.load_inline(**call) == "module" and fake.calls == 1, suffix
        assert cache.history[-1]["how"] == "torch" and (cache.programs / f"{name}.so").read_bytes() == b""
        assert (suffix == ".so" or not broken.exists()) and not list(cache.programs.glob("build-*"))
        assert cache.load_inline(**call) == "module" and fake.calls == 1   # loaded once, remembered


class _FailingTorchBuild(_FakeTorchBuild):
    """torch's load_inline failing with `log` as its build output."""

    def __init__(self, log: str):
        super().__init__()
        self.log = log

    def __call__(self, **arguments):
        self.calls += 1
        raise RuntimeError(f"Error building extension '{arguments['name']}': {self.log}")


def test_a_compile_error_is_built_once_per_cache(tmp_path, monkeypatch):
    """A compile error is remembered in the cache (`<name>.failed`): another BuildCache on it (another
    process: a prebuild, a worker) reports the same message without building. Both ways: the fast
    build's shared error, torch's build failing on an error line in a file; a failure without one
    (a killed compiler) is not remembered, so the next build tries again."""
    seen = []

    def shared(arguments, name, build_dir, *rest, **kwargs):
        seen.append(name)
        raise SharedCompileError(f'{build_dir}/cuda.cu(14): error: identifier "dice_nowhere" is undefined')
    monkeypatch.setattr(build_module, "fast_build", shared)
    call = dict(name="x", cpp_sources=CPP, cuda_sources=MANY, functions=["run"])
    with pytest.raises(BuildError, match='cuda.cu\\(14\\): error: identifier "dice_nowhere"') as first:
        BuildCache(tmp_path, capability=(9, 0), build="fast").load_inline(**call)
    with pytest.raises(BuildError) as again:
        BuildCache(tmp_path, capability=(9, 0), build="fast").load_inline(**call)
    assert str(again.value) == str(first.value) and len(seen) == 1 and str(tmp_path) not in str(first.value)
    assert [p.name for p in tmp_path.glob("*.failed")] == [f"{seen[0]}.failed"]

    for log, remembered in (("[1/3] c++ main.cpp\nFAILED: main.o\n/tmp/b/main.cpp:2:8: error: 'Tensr' in namespace "
                             "'torch' does not name a type", True),
                            ("FAILED: main.o\nc++: fatal error: Killed signal terminated program cc1plus", False),
                            ("FAILED: main.o\n/tmp/b/main.cpp:1:0: fatal error: error writing to -: No space left on "
                             "device", False)):
        calls = []
        for _ in range(2):
            cache = BuildCache(tmp_path, capability=(9, 0), build="torch")
            cache.real_load_inline = _FailingTorchBuild(log)
            with pytest.raises(BuildError, match="error"):
                cache.load_inline(**{**call, "cuda_sources": MANY.replace("BLOCK 256", f"BLOCK {len(log)}")})
            calls.append(cache.real_load_inline.calls)
        assert calls == ([1, 0] if remembered else [1, 1]), log


def test_the_gpu_session_prebuilds_what_its_selected_tests_verify():
    """tests/conftest.py's `wanted_builds`: a selected GPU test's module PREBUILD (the fast way) and
    its own prebuild marks, each program once in test order; nothing for tests left out or on the CPU."""
    import types

    from conftest import wanted_builds

    def item(module, keywords=("gpu",), marks=()):
        return types.SimpleNamespace(module=module, keywords=set(keywords),
                                     iter_markers=lambda name: [m for m in marks if m.name == name])
    verifier, inline = types.SimpleNamespace(PREBUILD=["relu", "broken"]), types.SimpleNamespace(PREBUILD=["ok"])
    slow = [pytest.mark.prebuild("templated").mark, pytest.mark.prebuild("ok", "bad", build="torch").mark]
    items = [item(verifier), item(verifier), item(inline, marks=slow), item(types.SimpleNamespace(), ("slow",)),
             item(types.SimpleNamespace(PREBUILD=["cpu"]), keywords=())]
    assert wanted_builds(items) == {"fast": ["relu", "broken", "ok", "templated"], "torch": ["ok", "bad"]}
    assert wanted_builds(items[:2]) == {"fast": ["relu", "broken"], "torch": []}


def _cpu_flags(root: Path, call: dict) -> tuple[dict, Flags]:
    """The arguments of one call and torch's flags for them, linked without the CUDA libraries the
    CPU wheel lacks."""
    arguments = BuildCache(root, capability=(9, 0), build="fast").arguments(**call)
    flags = Flags(arguments, "ext", (9, 0))
    flags.ldflags = [f for f in flags.ldflags if f not in CPU_ONLY_LIBRARIES]
    return arguments, flags


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One cache folder for the compiling tests, its toolchain artefacts (both bindings' precompiled
    headers, the generic binding's dispatcher; about 2.5 CPU-minutes here) built at once, as a
    verifier's first builds would."""
    root = tmp_path_factory.mktemp("inline-cache")
    if HAVE_NVCC:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
            _, flags = _cpu_flags(root, dict(name="many", cpp_sources=CPP, cuda_sources=MANY, functions=["run"]))
            slots = CompilerSlots(root)
            with ThreadPoolExecutor(3) as pool:
                for done in [pool.submit(precompiled_header, root, flags, slots, "pybind"),
                             pool.submit(precompiled_header, root, flags, slots, "dispatch"),
                             pool.submit(dispatcher, root, flags, slots)]:
                    done.result()
    return root


def _compile_only(tmp_path, call: dict, root: Path, binding: str = "pybind"):
    """The fast build of one call with `binding`, linked without the CUDA libraries the CPU wheel lacks."""
    from dice.verifier.inline_build import fast
    arguments, flags = _cpu_flags(root, call)
    return fast.fast_build(arguments, "ext", tmp_path, root, (9, 0), CompilerSlots(root), flags=flags,
                                binding=binding)


@pytest.mark.slow
def test_split_units_compile(tmp_path, cuda_home, shared_cache):
    """EXAMPLE_LOAD_INLINE and MANY compile the split way on a precompiled header; an error in
    cpp_sources is torch's own (SharedCompileError), one in a kernel only fails the fast build."""
    library, report = _compile_only(tmp_path, recorded_calls(EXAMPLE_LOAD_INLINE)[0], shared_cache)
    assert library.exists() and report["pch"] and report["binding"] == "pybind"
    # the rest with the generic binding, whose host unit compiles in a third of pybind's time
    many = dict(name="many", cpp_sources=CPP, cuda_sources=MANY, functions=["run"])
    (tmp_path / "m").mkdir()
    assert _compile_only(tmp_path / "m", many, shared_cache, "dispatch")[1]["kernels"] == ["affine", "total"]
    (tmp_path / "e").mkdir()
    with pytest.raises(SharedCompileError, match="main.cpp:2"):
        _compile_only(tmp_path / "e", {**many, "cpp_sources": "torch::Tensr run(torch::Tensor x, double a, double b);"},
                      shared_cache, "dispatch")
    (tmp_path / "k").mkdir()
    with pytest.raises(FastBuildFailed, match="cuda.cu"):
        _compile_only(tmp_path / "k", {**many, "cuda_sources": MANY.replace("y[i] = s.a", "y[i] = s.c")}, shared_cache,
                      "dispatch")
    # a name declared nowhere fails torch's build too: the verdict; `min` unqualified in host code
    # is declared by the CUDA headers torch's nvcc pass sees, so only torch's build can decide
    for binding in ("pybind", "dispatch"):
        (tmp_path / f"u{binding}").mkdir()
        with pytest.raises(SharedCompileError, match='identifier "dice_nowhere" is undefined'):
            _compile_only(tmp_path / f"u{binding}", {**many, "cuda_sources": MANY.replace("s.a * x[i]", "dice_nowhere")},
                          shared_cache, binding)
    (tmp_path / "h").mkdir()
    with pytest.raises(FastBuildFailed, match="min"):
        _compile_only(tmp_path / "h", {**many, "cuda_sources": MANY.replace("int64_t n = x.numel();",
                                                                           "int64_t n = min(x.numel(), 4L);")},
                      shared_cache, "dispatch")


def test_lazy_names_are_what_the_lazy_headers_declare(cuda_home, tmp_path):
    flags = Flags(dict.fromkeys(["extra_cflags", "extra_cuda_cflags", "extra_ldflags", "extra_include_paths"]), "ext",
                  (9, 0))
    names = lazy_names(tmp_path, flags)
    assert {"__half", "half", "__half2", "__nv_bfloat16", "nv_bfloat16", "__float2half", "__half2float", "hexp",
            "__hmax", "CUDART_ZERO_FP16", "__CUDA_FP16_H__", "sort", "clamp", "find", "count"} <= names
    # locals and parameters of their inline functions, and what the other headers declare already
    assert not names & {"i", "j", "idx", "x", "a", "float", "atomicAdd", "__shfl_down_sync", "__ldg", "max", "fmaxf"}


@pytest.mark.slow
def test_a_lean_device_unit_compiles_to_the_same_code_and_falls_back_when_it_fails(tmp_path, cuda_home, shared_cache,
                                                                                   monkeypatch):
    """Without <algorithm>, cuda_fp16.h and cuda_bf16.h a unit that names nothing of theirs gives
    the same PTX as with them; a unit that needs them (here every unit counts as naming nothing) fails lean and
    builds from the full unit, as torch's build would."""
    from dice.verifier.inline_build import fast
    many = dict(name="many", cpp_sources=CPP, cuda_sources=MANY, functions=["run"])
    (tmp_path / "m").mkdir()
    library, report = _compile_only(tmp_path / "m", many, shared_cache, "dispatch")
    assert library.exists() and report["lean_device"]
    arguments, flags = _cpu_flags(shared_cache, many)
    split_unit = split_program([CPP], [MANY], ["run"], True, str(tmp_path / "cuda.cu"), lazy_names=HALVES)
    ptx = []
    for name, text in (("lean", split_unit.device), ("full", split_unit.device_full)):
        (tmp_path / f"{name}.cu").write_text(text)
        subprocess.run([*flags.nvcc, *(f for f in flags.device() if not f.startswith("-gencode")), "-arch=compute_90",
                        "-ptx", str(tmp_path / f"{name}.cu"), "-o", str(tmp_path / f"{name}.ptx")], check=True,
                       capture_output=True)
        ptx.append((tmp_path / f"{name}.ptx").read_text())
    assert ".entry" in ptx[0] and ptx[0] == ptx[1]
    monkeypatch.setattr(fast, "lazy_names", lambda root, flags: frozenset())
    (tmp_path / "h").mkdir()
    library, report = _compile_only(tmp_path / "h", {**many, "cuda_sources": USES_HALF}, shared_cache, "dispatch")
    assert library.exists() and not report["lean_device"]


@pytest.fixture(scope="module")
def pool_cache(tmp_path_factory):
    """One build cache for the BuildPool tests: torch's build of PLUS (~40 s on 2 cores) is made once."""
    return tmp_path_factory.mktemp("pool-cache")


PLUS = "ext = load_inline('plus', 'int plus(int a, int b) { return a + b; }', functions=['plus'])"


@pytest.mark.slow
def test_build_pool_prebuilds_into_the_cache(pool_cache):
    """A BuildPool child builds (here: a C++-only extension, which takes torch's path) into the
    cache the workers use, so a later BuildCache.load_inline imports it without building; a
    candidate that hangs is killed at the timeout."""
    from dice.verifier.inline_build.pool import BuildPool
    program = f"from torch.utils.cpp_extension import load_inline\n{PLUS}\nraise SystemExit('not reached')\n"
    with BuildPool(pool_cache, processes=2, timeout_s=600, capability=(9, 0)) as pool:
        report = pool.submit(program).result()
        assert report["status"] in ("built", "cached"), report
        assert report["status"] == "cached" or report["builds"][0]["how"] == "torch", report
        assert pool.submit("import os\nos._exit(3)  # load_inline").result()["status"] == "error"
        assert pool.submit("x = 1").result()["status"] == "no build"
        # a child's stdin is /dev/null, never closed (nvcc cannot preprocess without one)
        stdin = pool.submit("import os  # load_inline\nraise RuntimeError(os.readlink('/proc/self/fd/0'))").result()
        assert stdin["status"] == "error" and stdin["message"] == "RuntimeError: /dev/null", stdin
        pool.timeout_s = 2
        assert pool.submit("while True: pass  # load_inline").result()["status"] == "timeout"
    cache = BuildCache(pool_cache / "torch_extensions", capability=(9, 0))
    cache.real_load_inline = _FakeTorchBuild()
    ext = cache.load_inline("plus", "int plus(int a, int b) { return a + b; }", functions=["plus"])
    assert ext.plus(2, 3) == 5 and cache.history == []


@pytest.mark.slow
def test_warming_builds_the_toolchain_before_the_first_program(tmp_path, cuda_home, monkeypatch):
    """`BuildCache.warm` (what `BuildPool.warm` runs in a build child) builds the precompiled headers
    and the names the fast build reads, so that the first program compiles none of them (here: no
    compiler may run for them afterwards)."""
    from dice.verifier.inline_build import toolchain
    root = tmp_path / "torch_extensions"
    BuildCache(root, capability=(9, 0), build="fast").warm()
    flags = Flags(dict.fromkeys(["extra_cflags", "extra_cuda_cflags", "extra_ldflags", "extra_include_paths"]), "ext",
                  (9, 0))
    monkeypatch.setattr(toolchain, "run_compiler", lambda *a, **k: pytest.fail("compiled after the warm-up"))
    monkeypatch.setattr(toolchain.subprocess, "run", lambda *a, **k: pytest.fail("preprocessed after the warm-up"))
    for binding in ("dispatch", "pybind"):
        assert precompiled_header(root, flags, CompilerSlots(root), binding).with_suffix(".h.gch").is_file()
    assert "__half" in lazy_names(root, flags) and "CUDA_KERNEL_ASSERT" in toolchain.torch_macros(root, flags)
    assert "at" in toolchain.header_names(root, flags)


@pytest.mark.slow
def test_build_pool_warms_in_a_child(tmp_path):
    """`BuildPool.warm` reaches a build child's `BuildCache.warm`: on a machine with a CUDA torch it
    reports "warmed"; with this CPU wheel, which knows no CUDA toolkit, the fast build's flags fail."""
    from dice.verifier.inline_build.pool import BuildPool
    with BuildPool(tmp_path, processes=1, timeout_s=600, capability=(9, 0)) as pool:
        report = pool.warm().result()
    assert report["status"] == "warmed" or (torch.version.cuda is None and report["status"] == "error" and
                                            "no CUDA toolkit" in report["message"]), report


def test_build_pool_builds_at_a_lower_cpu_priority(tmp_path):
    """Compilers yield the CPU to the threads that keep the GPU busy: a build child (and so every
    compiler it starts) runs at niceness BUILD_NICE, or its owner's where that is higher."""
    from dice.verifier.inline_build.pool import BUILD_NICE, BuildPool
    with BuildPool(tmp_path, processes=1, timeout_s=60, capability=(9, 0)) as pool:
        report = pool.submit("import os  # load_inline\nraise RuntimeError(os.nice(0))").result()
    assert report["status"] == "error", report
    assert report["message"] == f"RuntimeError: {max(BUILD_NICE, os.nice(0))}", report


def test_the_build_server_forks_its_children_from_a_single_thread(tmp_path):
    """A fork copies only the calling thread, so a lock another thread held then stays held in the
    child for ever: the server that forks every build runs one thread (counted in /proc)."""
    from dice.verifier.inline_build.pool import BuildPool
    with BuildPool(tmp_path, processes=1, timeout_s=60, capability=(9, 0)) as pool:
        pool.submit("import os  # load_inline\nraise RuntimeError('ok')").result()     # the server is up
        threads = os.listdir(f"/proc/{pool._server.pid}/task")
    assert len(threads) == 1, threads


GUARDLESS_OWNER = '''import sys
from dice.verifier.inline_build.pool import BuildPool
open(sys.argv[2], "a").write("ran\\n")       # once per execution of this script
program = ("import os, time\\nfrom torch.utils.cpp_extension import load_inline\\n"
           "if os.fork() == 0:\\n    os.setsid()\\n    if os.fork() == 0:\\n"
           "        open(%r + '.tmp', 'w').write(str(os.getpid()))\\n        os.rename(%r + '.tmp', %r)\\n"
           "        time.sleep(300)\\n    os._exit(0)\\n"
           "while not os.path.exists(%r):   # the daemon lives before the build starts\\n    time.sleep(0.01)\\n"
           "%s\\n" % (*[sys.argv[3]] * 4, sys.argv[4]))
with BuildPool(sys.argv[1], processes=1, timeout_s=600, capability=(9, 0)) as pool:
    print(pool.submit(program).result()["status"])
'''


@pytest.mark.slow
def test_build_pool_needs_no_main_guard_and_ends_what_a_candidate_started(tmp_path, pool_cache):
    """A script without `if __name__ == "__main__":` prebuilds a candidate that leaves a detached
    daemon (setsid + double fork): the script runs once (the build server is a subprocess, the
    script is never imported again), the build succeeds (or is found in the shared cache), and the
    daemon is dead once reported."""
    import subprocess
    import sys
    (tmp_path / "owner.py").write_text(GUARDLESS_OWNER)
    runs, daemon = tmp_path / "runs.txt", tmp_path / "daemon.pid"
    done = subprocess.run([sys.executable, str(tmp_path / "owner.py"), str(pool_cache), str(runs),
                           str(daemon), PLUS], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.strip() in ("built", "cached"), (done.stdout, done.stderr[-2000:])
    assert runs.read_text() == "ran\n"
    pid = int(daemon.read_text())
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), f"the candidate's daemon {pid} outlived its prebuild"


HANGING_PREBUILD_OWNER = '''import sys, time
from dice.verifier.inline_build.pool import BuildPool
pool = BuildPool(sys.argv[1], processes=1, timeout_s=600, capability=(9, 0))
pool.submit("open(%r, 'w').write('x')\\nwhile True: pass  # load_inline" % sys.argv[2])
time.sleep(600)
'''


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["owner", "build server"])
def test_no_prebuild_process_outlives_a_killed_owner(tmp_path, killed):
    """The owner of a BuildPool, or its build server, is SIGKILLed while a candidate spins in a
    prebuild child: the server sees its input close and ends the child and itself, or the child
    sees its server gone and ends itself and what it started, within 10 s (each polls every 0.1 s;
    the server runs at nice 10, so other work on a loaded 2-core machine delayed it past 2 s once)."""
    import os
    import signal
    import subprocess
    import sys
    from dice.verifier.keeper import descendants
    (tmp_path / "owner.py").write_text(HANGING_PREBUILD_OWNER)
    started = tmp_path / "started"
    owner = subprocess.Popen([sys.executable, str(tmp_path / "owner.py"), str(tmp_path / "cache"), str(started)],
                             cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists(), "the prebuild child never ran"
    tree = descendants(owner.pid)
    assert len(tree) >= 2, tree          # the server and its child
    server = next(p for p in tree if Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[1] == str(owner.pid))
    os.kill(owner.pid if killed == "owner" else server, signal.SIGKILL)
    if killed == "owner":
        owner.wait(timeout=30)

    def alive(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    deadline = time.monotonic() + 10
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in tree), [p for p in tree if alive(p)]
    owner.kill()
    owner.wait(timeout=30)


BOUND = r'''
torch::Tensor scaled(torch::Tensor x, double a, int b, bool negate) {
    TORCH_CHECK(x.dim() > 0, "x must have a dimension");
    auto y = x * (a * b);
    return negate ? -y : y;
}
std::vector<torch::Tensor> views(const torch::Tensor& x, std::vector<int64_t> shape) { return {x.reshape(shape), x + 1}; }
torch::Tensor mixed(torch::Tensor x, const std::vector<double>& scales, std::vector<int> sizes, std::vector<float> shifts) {
    return x * scales.at(0) + sizes.at(0) + shifts.at(0);
}
std::tuple<torch::Tensor, torch::Tensor> maybe(torch::Tensor x, c10::optional<torch::Tensor> y) {
    return {x, y.has_value() ? *y : x * 0};
}
int64_t count(torch::Tensor x) { return x.numel(); }
double halved(float f) { return f / 2; }
void check(torch::Tensor x) { TORCH_CHECK_VALUE(x.numel() < 3, "too many"); TORCH_CHECK_INDEX(x.numel() > 0, "empty"); }
'''
BOUND_DECLARATIONS = """torch::Tensor scaled(torch::Tensor x, double a, int b, bool negate);
std::vector<torch::Tensor> views(const torch::Tensor& x, std::vector<int64_t> shape);
torch::Tensor mixed(torch::Tensor x, const std::vector<double>& scales, std::vector<int> sizes, std::vector<float> shifts);
std::tuple<torch::Tensor, torch::Tensor> maybe(torch::Tensor x, c10::optional<torch::Tensor> y);
int64_t count(torch::Tensor x);
double halved(float f);
void check(torch::Tensor x);"""
BOUND_FUNCTIONS = ["scaled", "views", "mixed", "maybe", "count", "halved", "check"]


def _bound_calls():
    import numpy as np
    x = torch.arange(6.0)
    return [("scaled", (x, 0.5, 4, True)), ("scaled", (x, 1, 2, False)), ("scaled", (x, 0.5, 4.5, True)),
            ("scaled", (x, 0.5, True, True)), ("scaled", (x, 0.5, np.int64(3), False)), ("scaled", (x, 0.5, 2**40, False)),
            ("scaled", (1, 0.5, 4, True)), ("scaled", (x, 0.5, 4)), ("scaled", (torch.tensor(1.0), 1.0, 1, False)),
            ("scaled", (x, torch.tensor(2.0), 1, False)), ("scaled", (x, 0.5, 4, 1)), ("scaled", (x, "a", 4, True)),
            ("views", (x, [2, 3])), ("views", (x, (3, 2))), ("views", (x, [2, 3.0])), ("views", (x, 6)),
            ("mixed", (x, [0.5], [3], [0.25])), ("mixed", (x, (2,), [2**40], [1.0])), ("mixed", (x, [1.0], [1.5], [1.0])),
            ("mixed", (x, [], [1], [1.0])),
            ("maybe", (x, None)), ("maybe", (x, x)), ("maybe", (x, 3)), ("count", (x,)), ("halved", (3,)),
            ("halved", (2.5,)), ("halved", ("a",)), ("check", (x,)), ("check", (x[:0],)), ("check", (x[:1],))]


def _outcome(module, name, args, **kwargs):
    try:
        value = getattr(module, name)(*args, **kwargs)
    except Exception as exc:
        return "raises", type(exc).__name__
    flat = list(value) if isinstance(value, (list, tuple)) else [value]
    return type(value).__name__, [v.tolist() if isinstance(v, torch.Tensor) else v for v in flat]


@pytest.mark.slow
def test_generic_binding_converts_and_raises_as_torchs_binding(tmp_path, cuda_home, shared_cache):
    """Independent truth: torch's own load_inline binding (pybind11, torch's error handling) of
    the same functions. Every call, good or bad (a float for an int, an int for a tensor, a
    wrong count, keywords, a failed TORCH_CHECK_VALUE/INDEX), returns the same values or raises
    the same exception type through the generic binding (dispatch.h/dispatch.cpp)."""
    from torch.utils.cpp_extension import load_inline
    reference = load_inline("bound_torch", [BOUND], functions=BOUND_FUNCTIONS, build_directory=str(tmp_path))
    (tmp_path / "fast").mkdir()
    call = dict(name="bound", cpp_sources=BOUND_DECLARATIONS, functions=BOUND_FUNCTIONS,
                cuda_sources=HEADER + "__global__ void unused(float* y) {}\n" + BOUND)
    library, report = _compile_only(tmp_path / "fast", call, shared_cache, "dispatch")
    assert report["binding"] == "dispatch" and "PYBIND11_MODULE" not in (tmp_path / "fast" / "main.cpp").read_text()
    generic = build_module.load_dispatched("bound", library, report["dispatcher"])
    for name, args in _bound_calls():
        assert _outcome(generic, name, args) == _outcome(reference, name, args), (name, args)
    assert _outcome(generic, "count", (), x=None) == _outcome(reference, "count", (), x=None) == ("raises", "TypeError")


@pytest.mark.slow
def test_build_cache_builds_and_reloads_the_generic_binding(tmp_path, cuda_home, shared_cache, monkeypatch):
    """BuildCache's fast build of a program with functions uses the generic binding; a fresh
    cache on the same folder loads the library from its `.dispatch.so` and pointer, building nothing."""
    real_init = Flags.__init__

    def cpu_flags(self, *args):
        real_init(self, *args)
        self.ldflags = [f for f in self.ldflags if f not in ("-lc10_cuda", "-ltorch_cuda")]
    monkeypatch.setattr(Flags, "__init__", cpu_flags)
    call = dict(name="bound", cpp_sources=BOUND_DECLARATIONS, functions=BOUND_FUNCTIONS,
                cuda_sources=HEADER + "__global__ void unused(float* y) {}\n" + BOUND)
    cache = BuildCache(shared_cache, capability=(9, 0), build="fast")
    module = cache.load_inline(**call)
    assert cache.history[-1]["how"] == "fast" and cache.history[-1]["dispatcher"]
    assert module.count(torch.ones(3)) == 3
    again = BuildCache(shared_cache, capability=(9, 0), build="fast")
    assert again.load_inline(**call).views.__name__ == "views" and again.history == []


def test_only_a_candidate_with_load_inline_programs_waits_for_the_toolchain(tmp_path):
    """The first CuPy candidate waited ~40 s on an H100 for a precompiled header it never uses:
    `toolchain(wait=False)` answers at once, with the warm-up's digests once reported and {} (the
    shared artifacts trusted by no build of that candidate) while it runs; `toolchain()` waits for them."""
    from concurrent.futures import Future
    from dice.verifier.inline_build.pool import BuildPool
    with BuildPool(tmp_path, processes=1, timeout_s=60, capability=(9, 0)) as pool:
        assert pool.toolchain(wait=False) is None and pool.toolchain() is None      # no warm-up: nothing to trust
        pool._warm = Future()
        assert pool.toolchain(wait=False) == {}
        pool._warm.set_result({"status": "warmed", "toolchain": {"pch": "digest"}})
        assert pool.toolchain(wait=False) == {"pch": "digest"} == pool.toolchain()


def _candidate(cuda_sources: str, before: str = "") -> str:
    """A candidate.py whose one load_inline call builds MANY-like `cuda_sources` (the generic binding)."""
    return (f"from torch.utils.cpp_extension import load_inline\n{before}"
            f"ext = load_inline('many', {CPP!r}, cuda_sources={cuda_sources!r}, functions=['run'])\n")


@pytest.mark.slow
def test_a_group_shares_its_host_unit_through_trusted_builds_that_no_planted_unit_reaches(tmp_path, monkeypatch):
    """BuildPool (DESIGN.md §8.4): a candidate's one load_inline call is built by a trusted builder
    (`pool._build_delegated`) into the candidate's own folder, its compiled units shared under the
    seal: three programs differing in a kernel's body compile one host unit between them. A unit a
    candidate's process changes in the shared store fails its seal and is compiled again; a
    candidate's process holds no seal. (Linked against empty stand-ins of the CUDA libraries the
    CPU wheel lacks.)"""
    if not HAVE_NVCC:
        pytest.skip("needs nvcc and g++")
    from dice.verifier.inline_build.pool import BuildPool
    stand_ins = tmp_path / "libs"
    stand_ins.mkdir()
    for lib in ("c10_cuda", "torch_cuda"):
        subprocess.run(["c++", "-shared", "-x", "c++", "/dev/null", "-o", str(stand_ins / f"lib{lib}.so")], check=True)
    monkeypatch.setenv("LIBRARY_PATH", str(stand_ins))
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda")   # the server is a process of its own
    body = "if (i < n) y[i] = s.a * x[i] + s.b;"
    variants = [MANY.replace(body, body.replace("s.b;", f"s.b + {k}.0f;")) for k in range(3)]
    root = tmp_path / "cache" / "torch_extensions"
    with BuildPool(tmp_path / "cache", processes=2, timeout_s=600, capability=(9, 0)) as pool:
        warmed = pool.warm().result()
        assert warmed["status"] == "warmed", warmed
        folders = [root / "candidates" / f"c{k}" for k in range(4)]
        reports = [pool.submit(_candidate(v), folder) for v, folder in zip(variants, folders)]
        reports = [r.result() for r in reports]
        assert all(r["status"] == "built" for r in reports), reports
        hosts = [b["host_cpu_s"] > 0 for r in reports for b in r["builds"]]
        assert sorted(hosts) == [False, False, True], reports   # one host unit compiled, two copied
        assert all(list(f.glob("dice_ext_*.so")) for f in folders[:3])
        for r, f in zip(reports, folders):   # what the worker will load from the folder: these bytes alone
            [(name, pin)] = r["pins"].items()
            library = f / (f"{name}.dispatch.so" if pin["dispatcher"] else f"{name}.so")
            assert pin["sha256"] == hashlib.sha256(library.read_bytes()).hexdigest(), r
        assert not any((f / "objects").exists() for f in folders[:3])   # units only in the sealed store
        kept = sorted((root / "objects").rglob("*.o"))
        assert len(kept) == 4 and all(o.with_suffix(".mac").is_file() for o in kept)   # 1 host + 3 device
        for o in kept:   # what a candidate's process could do to the store
            o.write_bytes(b"planted")
        again = pool.submit(_candidate(variants[0].replace("+ 0.0f", "+ 7.0f")), folders[3]).result()
        assert again["status"] == "built" and again["builds"][0]["host_cpu_s"] > 0, again
        resealed = next(o for o in (root / "objects").rglob("*.o") if o.read_bytes() != b"planted")
        message = b"\0".join([resealed.stem.encode(), hashlib.sha256(resealed.read_bytes()).digest(),
                              hashlib.sha256(resealed.with_suffix(".log").read_bytes()).digest()])
        assert resealed.with_suffix(".mac").read_bytes() != hmac.new(bytes(32), message, hashlib.sha256).digest()
        seal = pool.submit(_candidate(variants[0], "import sys\nraise RuntimeError(bytes(sys.modules['__main__'].SEAL).hex())\n")
                           ).result()
        assert seal["status"] == "error" and seal["message"] == "RuntimeError: " + "00" * 32, seal


def test_a_unit_lock_held_too_long_is_passed_by(tmp_path):
    """A compiled unit's lock that another process holds (a candidate's could, for ever) is waited
    for at most the given seconds (`fast._locked_within`); then the build compiles on its own."""
    from dice.verifier.inline_build.fast import _locked_within
    path = tmp_path / "unit.lock"
    with open(path, "w") as holder, open(path, "w") as waiter:
        fcntl.flock(holder, fcntl.LOCK_EX)
        start = time.monotonic()
        assert not _locked_within(waiter, 0.3)
        assert 0.3 <= time.monotonic() - start < 2.0
        fcntl.flock(holder, fcntl.LOCK_UN)
        assert _locked_within(waiter, 0.3)
