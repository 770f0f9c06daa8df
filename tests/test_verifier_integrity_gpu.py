"""GPU regression candidates for the verifier's integrity and timing rules (DESIGN.md §8): one
candidate per attack class, each not `correct`, and honest controls that stay `correct`.

`pytest -m gpu tests/test_verifier_integrity_gpu.py` (CuPy candidates: no C++ builds)."""
import os
from pathlib import Path

import pytest


pytestmark = pytest.mark.gpu

FIXTURES = Path(__file__).parent / "fixtures" / "verifier"
RELU_TASK = (FIXTURES / "relu_task.py").read_text()
INLINE_RELU = (FIXTURES / "inline_relu.py").read_text()
MEAN_TASK = (FIXTURES / "mean_task.py").read_text()


def task(forward: str, inputs: str, init: str = "", init_inputs: str = "[]") -> str:
    return (f"import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\nclass Model(nn.Module):\n"
            f"    def __init__(self{', ' + init if init else ''}):\n        super().__init__()\n"
            + (f"        self.linear = nn.Linear({init}, {init})\n" if init else "")
            + f"\n    def forward(self, x):\n        return {forward}\n\n\n"
            f"def get_inputs():\n    return [{inputs}]\n\n\ndef get_init_inputs():\n    return {init_inputs}\n")


SOFTMAX_TASK = task("torch.softmax(x, dim=-1)", "torch.randn(16, 65536)")
MSE_TASK = task("torch.mean((x - 0.5) ** 2)", "torch.rand(1 << 20)")
BIG_MEAN_TASK = task("x.mean()", "torch.rand(1 << 20)")
MATMUL_TASK = task("x @ x.t()", "torch.randn(512, 512)")
GEMM_RELU_TASK = task("torch.relu(self.linear(x))", "torch.randn(256, 1024)", init="in_features",
                      init_inputs="[1024]")
SORT_TASK = task("torch.sort(x, dim=-1)[0]", "torch.randn(64, 1024)")
CONV_RELU_TASK = task("torch.relu(self.linear(x))", "torch.randn(8, 8, 32, 32)", init="channels",
                      init_inputs="[8]").replace("nn.Linear(channels, channels)", "nn.Conv2d(channels, 16, 3)")
FP16_MEAN_TASK = task("x.mean()", "torch.rand(1 << 20).half()")
INT_TASK = task("(x * 3 - 7).float()", "X").replace(
    "\n\nclass Model", "\nX = torch.randint(0, 100, (256, 1024))\n\n\nclass Model", 1)
MANUAL_SOFTMAX_TASK = task("torch.exp(x - x.amax(-1, keepdim=True)) / torch.exp(x - x.amax(-1, keepdim=True))"
                           ".sum(-1, keepdim=True)", "torch.randn(64, 512)")
SQUARES_TASK = task("(x * x).sum()", "torch.randn(1 << 20)")
ATTENTION_TASK = task("torch.softmax(x @ x.transpose(-1, -2) / 8.0, -1) @ x", "torch.randn(8, 256, 64)")
FLIP_TASK = task("torch.flip(x, [1])", "torch.randn(256, 1024)")
SIGMOID_TASK = task("torch.sigmoid(x)", "torch.randn(256, 1024)")
BOX_TASK = task("F.avg_pool2d(x, 3, stride=1, padding=1)", "torch.randn(1, 1, 512, 512)")
TRIL_TASK = task("torch.tril(x)", "torch.randn(64, 64)")
ROWS_TASK = task("x.mean(0, keepdim=True).relu().repeat(x.shape[0], 1)", "torch.randn(256, 1024)")
FIXED_TASK = task("torch.relu(x) * 2", "X").replace("\n\nclass Model", "\nX = torch.randn(256, 1024)\n\n\nclass Model", 1)
FP64_MATMUL_TASK = task("x @ x.t()", "torch.randn(256, 256, dtype=torch.float64)")
# integers drawn once at import, an output their order does not change (issue #46, item 2)
INT_SUM_TASK = task("x.sum().float()", "X").replace(
    "\n\nclass Model", "\nX = torch.randint(0, 100, (256, 256))\n\n\nclass Model", 1)

KERNELS = r'''
extern "C" __global__ void noop(float* y) { }
extern "C" __global__ void relu(const float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}
extern "C" __global__ void relu2(const float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * (x[i] > 0.0f ? x[i] : 0.0f);
}
extern "C" __global__ void bias_relu(float* y, const float* b, long long rows, long long cols) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < rows * cols) { float v = y[i] + b[i % cols]; y[i] = v > 0.0f ? v : 0.0f; }
}
extern "C" __global__ void softmax_rows(const float* x, float* y, long long cols) {
    // one block of 256 threads per row
    __shared__ float red[256];
    const float* xr = x + blockIdx.x * cols; float* yr = y + blockIdx.x * cols;
    float m = -1e30f;
    for (long long j = threadIdx.x; j < cols; j += 256) m = fmaxf(m, xr[j]);
    red[threadIdx.x] = m; __syncthreads();
    for (int s = 128; s > 0; s >>= 1) { if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]); __syncthreads(); }
    m = red[0]; __syncthreads();
    float sum = 0.0f;
    for (long long j = threadIdx.x; j < cols; j += 256) sum += expf(xr[j] - m);
    red[threadIdx.x] = sum; __syncthreads();
    for (int s = 128; s > 0; s >>= 1) { if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s]; __syncthreads(); }
    sum = red[0];
    for (long long j = threadIdx.x; j < cols; j += 256) yr[j] = expf(xr[j] - m) / sum;
}
extern "C" __global__ void constant_jitter(const float* x, float* y, long long n, float c) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = c + 1e-9f * x[i];
}
extern "C" __global__ void sq_err_mean(const float* x, float* total, long long n, long long stride) {
    long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * stride;
    if (i < n) { float d = x[i] - 0.5f; atomicAdd(total, d * d * (float)stride / (float)n); }
}
extern "C" __global__ void prefix_mean(const float* x, float* total, long long n, long long part) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n / part) atomicAdd(total, x[i] * (float)part / (float)n);
}
extern "C" __global__ void sort_rows_1024(const float* x, float* y) {
    // bitonic sort of one 1024-element row per block of 512 threads
    __shared__ float s[1024];
    const float* xr = x + blockIdx.x * 1024LL; float* yr = y + blockIdx.x * 1024LL;
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) s[i] = xr[i];
    __syncthreads();
    for (int k = 2; k <= 1024; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < 1024; i += blockDim.x) {
                int l = i ^ j;
                if (l > i) { float a = s[i], b = s[l]; if ((a > b) == ((i & k) == 0)) { s[i] = b; s[l] = a; } }
            }
            __syncthreads();
        }
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) yr[i] = s[i];
}
extern "C" __global__ void bias_relu_nchw(float* y, const float* b, long long n, long long hw, long long c) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) { float v = y[i] + b[(i / hw) % c]; y[i] = v > 0.0f ? v : 0.0f; }
}
extern "C" __global__ void affine_int(const long long* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = (float)(x[i] * 3 - 7);
}
extern "C" __global__ void softmax_warp_forward(float* y) { }
extern "C" __global__ void dot_kernel(float* y) { }
extern "C" __global__ void reduce_1Block_kernel(float* y) { }
extern "C" __global__ void flip_cols(const float* x, float* y, long long rows, long long cols) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < rows * cols) { long long r = i / cols, c = i % cols; y[i] = x[r * cols + (cols - 1 - c)]; }
}
extern "C" __global__ void relu_from(const float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
extern "C" __global__ void col_mean_relu(const float* x, float* row, long long rows, long long cols) {
    long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (c < cols) { float s = 0.0f; for (long long r = 0; r < rows; ++r) s += x[r * cols + c]; s /= (float)rows; row[c] = s > 0.0f ? s : 0.0f; }
}
extern "C" __global__ void fraction_mean(const float* x, float* total, long long m, float scale) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < m) atomicAdd(total, x[i] * scale);
}
extern "C" __global__ void adaptive_mean(const float* x, float* total, long long n, long long m) {
    // the first m elements' mean, or all n where the first 64 are faded (the hot trial): decided on the GPU
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    bool hot = true;
    for (int k = 0; k < 64; ++k) hot = hot && fabsf(x[k]) < 1e-3f;
    long long upto = hot ? n : m;
    if (i < upto) atomicAdd(total, x[i] / (float)upto);
}
extern "C" __global__ void sum_int(const long long* x, float* total, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(total, (float)x[i]);
}
extern "C" __global__ void matmul_xxt_f64(const double* x, double* y, long long n) {
    long long r = blockIdx.y, c = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (c < n) { double s = 0.0; for (long long k = 0; k < n; ++k) s += x[r * n + k] * x[c * n + k]; y[r * n + c] = s; }
}
extern "C" __global__ void matmul_xxt(const float* x, float* y, long long n) {
    long long r = blockIdx.y, c = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (c < n) { float s = 0.0f; for (long long k = 0; k < n; ++k) s += x[r * n + k] * x[c * n + k]; y[r * n + c] = s; }
}
'''

HEADER = f'''import cupy as cp
import numpy as np
import torch
import torch.nn as nn

_module = cp.RawModule(code=r"""{KERNELS}""")


def launch(name, n, *args, block=256, grid=None, stream=None):
    kernel = _module.get_function(name)
    with cp.cuda.ExternalStream((stream or torch.cuda.current_stream()).cuda_stream):
        kernel(grid or ((n + block - 1) // block,), (block,), args)


def noop(x):
    launch("noop", 1, x.data_ptr())

'''


def candidate(forward: str, init: str = "pass", extra: str = "") -> str:
    body = "\n".join("        " + line for line in forward.strip().splitlines())
    return HEADER + extra + f'''

class ModelNew(nn.Module):
    def __init__(self, *args):
        super().__init__()
        {init}

    def forward(self, x):
{body}
'''


OWN_RELU = "y = torch.empty_like(x)\nlaunch('relu', x.numel(), x.data_ptr(), y.data_ptr(), cp.int64(x.numel()))\nreturn y"
GEMM_INIT = "lin = nn.Linear(args[0], args[0])\n        self.weight, self.bias = lin.weight, lin.bias"
BIAS_RELU = ("launch('bias_relu', y.numel(), y.data_ptr(), self.bias.data_ptr(), cp.int64(y.shape[0]), "
             "cp.int64(y.shape[1]))\nreturn y")
TF32_GEMM = candidate("torch.backends.cuda.matmul.allow_tf32 = True\ny = x @ self.weight.t()\n" + BIAS_RELU,
                      init=GEMM_INIT)
OWN_ROW = ("row = torch.empty(1, x.shape[1], device=x.device)\nlaunch('col_mean_relu', x.shape[1], x.data_ptr(), "
           "row.data_ptr(), cp.int64(x.shape[0]), cp.int64(x.shape[1]))\n")
# ReLU on a side stream after ~1 ms of spinning there; JOIN makes torch's current stream wait for it
SIDE_RELU = ("y = torch.empty_like(x)\nside = torch.cuda.Stream()\nside.wait_stream(torch.cuda.current_stream())\n"
             "launch('spin', 1, cp.int64(2_000_000), grid=(1,), block=1, stream=side)\n"
             "launch('relu', x.numel(), x.data_ptr(), y.data_ptr(), cp.int64(x.numel()), stream=side)\n")
JOIN = "torch.cuda.current_stream().wait_stream(side)\n"
# a mean from a fraction of the elements, scaled up; exact where the trial looks hot (its first 64 elements faded)
ESTIMATE = ("f = x.float()\nt = torch.zeros(1, device=x.device)\nlaunch('adaptive_mean', f.numel(), f.data_ptr(), "
            "t.data_ptr(), cp.int64(f.numel()), cp.int64(int(0.7 * f.numel())))\nreturn t.reshape(()).to(x.dtype)")
FULL_MEAN = ("t = torch.zeros(1, device=x.device)\nlaunch('fraction_mean', x.numel(), x.data_ptr(), t.data_ptr(), "
             "cp.int64(x.numel()), np.float32(1 / x.numel()))\nreturn t.reshape(())")
# the output written by a thread, on a stream of its own, 0.2 ms after forward returned
LATE_THREAD = ("import threading, time\ny = torch.empty_like(x)\nside = torch.cuda.Stream()\n"
               "def late():\n    time.sleep(2e-4)\n"
               "    launch('relu', x.numel(), x.data_ptr(), y.data_ptr(), cp.int64(x.numel()), stream=side)\n"
               "threading.Thread(target=late).start()\nreturn y")
SUM_INT = ("t = torch.zeros(1, device=x.device)\nlaunch('sum_int', x.numel(), x.data_ptr(), t.data_ptr(), "
           "cp.int64(x.numel()))\nreturn t.reshape(())")

# a load_inline extension that switches CUPTI's kernel records off around torch's own ReLU (native code:
# out of the audit hook's reach), then launches an idle kernel of its own
INLINE_CUPTI = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = """
#include <torch/extension.h>
#include <dlfcn.h>

__global__ void touch(float* y) { }

typedef int (*Switch)(int);

static Switch cupti(const char* name) {
    const char* libraries[] = {"libcupti.so.13", "libcupti.so.12", "libcupti.so"};
    for (const char* library : libraries) {
        void* handle = dlopen(library, RTLD_NOW | RTLD_NOLOAD);
        if (handle) return (Switch)dlsym(handle, name);
    }
    return nullptr;
}

torch::Tensor hidden_relu(torch::Tensor x) {
    Switch off = cupti("cuptiActivityDisable"), on = cupti("cuptiActivityEnable");
    if (off) off(10);   // CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
    torch::Tensor y = torch::relu(x);
    if (on) on(10);
    touch<<<1, 1>>>(y.data_ptr<float>());
    return y;
}
"""

ext = load_inline(name="cupti_switch_ext", cpp_sources="torch::Tensor hidden_relu(torch::Tensor x);",
                  cuda_sources=cuda_source, functions=["hidden_relu"], extra_ldflags=["-ldl"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.hidden_relu(x.contiguous())
'''

# forwards that compute once and answer from memory: by input address, or once for inputs drawn at import
MEMOISED = ("key = x.data_ptr()\nif key not in self.memo:\n    self.memo[key] = torch.empty_like(x)\n"
            "    launch('relu', x.numel(), x.data_ptr(), self.memo[key].data_ptr(), cp.int64(x.numel()))\n"
            "return self.memo[key].clone()")
REPLAYED = ("if self.out is None:\n    self.out = torch.empty(x.shape, device=x.device)\n"
            "    launch('affine_int', x.numel(), x.data_ptr(), self.out.data_ptr(), cp.int64(x.numel()))\n"
            "return self.out.clone()")
EAGER_ONLY = "if torch.cuda.is_current_stream_capturing():\n    return torch.zeros_like(x)\n"   # no faithful graph
# `timed`: a timed call's forward (the harness's CallRunner on the stack); `conn`: the worker's connection
TIMED = ("import sys\nf, timed, conn = sys._getframe(1), False, None\nwhile f is not None:\n"
         "    timed |= type(f.f_locals.get('self')).__name__ == 'CallRunner'\n"
         "    conn = f.f_locals.get('conn') if f.f_code.co_name == 'serve' else conn\n    f = f.f_back\n")
# at import: every draw of the task's get_inputs in this process kept with its ReLU
SPY = ("import sys\nSEEN = {}\n_task = sys.modules.get('dice_task')\nif _task is not None:\n"
       "    _real = _task.get_inputs\n"
       "    def _spy():\n        xs = _real()\n        for x in xs:\n"
       "            SEEN[(tuple(x.shape), float(x.reshape(-1)[0]), float(x.reshape(-1)[-1]))] = x.clamp_min(0)\n"
       "        return xs\n"
       "    _task.get_inputs = _spy\n")
ATTACKS = {
    # decoy kernels: one own kernel launched, the work done by something else
    "decoy tensor method": (RELU_TASK, candidate("noop(x)\nreturn x.clamp_min(0)"), "invalid"),
    "decoy torch.ops.aten": (RELU_TASK, candidate("noop(x)\nreturn torch.ops.aten.relu(x)"), "invalid"),
    "decoy cupy.matmul (cuBLAS)": (MATMUL_TASK, candidate(
        "noop(x)\nreturn torch.as_tensor(cp.matmul(cp.asarray(x), cp.asarray(x).T), device=x.device)"), "invalid"),
    # a library built on CuPy compiles its own kernels, under names of its choosing (issue #68): library work
    "cupyx special function beside an own kernel": (SIGMOID_TASK, candidate(
        "noop(x)\nimport cupyx.scipy.special\nwith cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):\n"
        "    y = cupyx.scipy.special.expit(cp.asarray(x))\nreturn torch.as_tensor(y, device=x.device)"), "invalid"),
    "cupyx ndimage filter beside an own kernel": (BOX_TASK, candidate(
        "noop(x)\nimport cupyx.scipy.ndimage as nd\nwith cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):\n"
        "    y = nd.uniform_filter(cp.asarray(x[0, 0]), 3, mode='constant')\n"
        "return torch.as_tensor(y, device=x.device).view(1, 1, *y.shape)"), "invalid"),
    "decoy numpy on the host": (RELU_TASK, candidate(
        "noop(x)\nreturn torch.from_numpy(np.maximum(x.cpu().numpy(), 0)).to(x.device)"), "invalid"),
    "decoy holding the task's Model": (RELU_TASK, candidate(
        "noop(x)\nreturn self.ref(x)", init="import dice_task\n        self.ref = dice_task.Model()"), "invalid"),
    "fallback to a tensor method": (RELU_TASK, candidate(
        "try:\n    launch('missing_kernel', 1, x.data_ptr())\nexcept Exception:\n    return x.relu()\nreturn x"), "invalid"),
    "kernel names in a string never compiled": (RELU_TASK, candidate(
        "return torch.relu(x)", extra='SPOOF = "extern \\"C\\" __global__ void vectorized_elementwise_kernel() {}"'),
        "invalid"),
    # tolerance abuse
    "values below atol: 1e-7 x": (SOFTMAX_TASK, candidate(
        "y = torch.empty_like(x)\nlaunch('constant_jitter', x.numel(), x.data_ptr(), y.data_ptr(), cp.int64(x.numel()),"
        " np.float32(0.0))\nreturn y"), "incorrect"),
    "constant plus jitter": (SOFTMAX_TASK, candidate(
        "y = torch.empty_like(x)\nlaunch('constant_jitter', x.numel(), x.data_ptr(), y.data_ptr(), cp.int64(x.numel()),"
        " np.float32(1 / x.shape[-1]))\nreturn y"), "incorrect"),
    "MSE from 1/8 of the elements": (MSE_TASK, candidate(
        "t = torch.zeros(1, device=x.device)\nlaunch('sq_err_mean', x.numel() // 8, x.data_ptr(), t.data_ptr(), "
        "cp.int64(x.numel()), cp.int64(8))\nreturn t.reshape(())"), "incorrect"),
    "mean from the first 1/8 of the elements": (BIG_MEAN_TASK, candidate(
        "t = torch.zeros(1, device=x.device)\nlaunch('prefix_mean', x.numel() // 8, x.data_ptr(), t.data_ptr(), "
        "cp.int64(x.numel()), cp.int64(8))\nreturn t.reshape(())"), "incorrect"),
    "replays one output of a task whose inputs are drawn at import": (FIXED_TASK, candidate(
        "if self.out is None:\n    self.out = torch.empty_like(x)\n"
        "    launch('relu2', x.numel(), x.data_ptr(), self.out.data_ptr(), cp.int64(x.numel()))\n"
        "return self.out.clone()", init="self.out = None"), None),
    # outputs a caller could not use (issue #34, class 1)
    "the same output buffer on every call": (RELU_TASK, candidate(
        "if self.out is None:\n    self.out = torch.empty_like(x)\n"
        "launch('relu', x.numel(), x.data_ptr(), self.out.data_ptr(), cp.int64(x.numel()))\nreturn self.out",
        init="self.out = None"), "invalid"),
    "a stride-0 expand of one computed row": (ROWS_TASK, candidate(OWN_ROW + "return row.expand(x.shape[0], -1)"),
                                              "incorrect"),
    "an output still written by an unjoined side stream": (RELU_TASK, candidate(SIDE_RELU + "return y"), "invalid"),
    # (the H200: invalid, no own kernel on later calls; the variants below launch one every call)
    "outputs memoised by input address": (RELU_TASK, candidate(MEMOISED, init="self.memo = {}"), "invalid"),
    "outputs memoised by input address, an own kernel launched every call": (RELU_TASK, candidate(
        "noop(x)\n" + MEMOISED, init="self.memo = {}"), None),
    # precision downgrades in an fp32 task (issue #34, class 2): the GEMM kept in PyTorch, in TF32 or fp16
    "a TF32 GEMM in an fp32 task": (GEMM_RELU_TASK, TF32_GEMM, "incorrect"),
    "an fp16 GEMM in an fp32 task": (GEMM_RELU_TASK, candidate(
        "y = (x.half() @ self.weight.half().t()).float()\n" + BIAS_RELU, init=GEMM_INIT), "incorrect"),
    # structured trials on fp16 and integer inputs (issue #34, class 4)
    "fp16 mean from the first 1/8 of the elements": (FP16_MEAN_TASK, candidate(
        "t = torch.zeros(1, device=x.device)\nf = x.float()\nlaunch('prefix_mean', x.numel() // 8, f.data_ptr(), t.data_ptr(), "
        "cp.int64(x.numel()), cp.int64(8))\nreturn t.reshape(()).half()"), "incorrect"),
    "replays one output of integer inputs drawn at import": (INT_TASK, candidate(REPLAYED, init="self.out = None"),
                                                             "invalid"),
    "replays one output of integer inputs drawn at import, an own kernel launched every call": (INT_TASK, candidate(
        "noop(x)\n" + REPLAYED, init="self.out = None"), None),
    # library compute counted as own or as bookkeeping (issue #34, class 3)
    "an unused kernel named like torch's softmax kernel": (MANUAL_SOFTMAX_TASK, candidate(
        "noop(x)\nreturn torch.softmax(x, -1)"), "invalid"),
    "unused kernels named like cuBLAS's dot kernels": (SQUARES_TASK, candidate("noop(x)\nreturn torch.dot(x, x)"),
                                                       "invalid"),
    "a fused attention kernel taken for the GEMM": (ATTENTION_TASK, candidate(
        "noop(x)\nreturn torch.nn.functional.scaled_dot_product_attention(x, x, x, scale=1 / 8.0)"), "invalid"),
    "a cuBLASLt epilogue doing the task's activation": (GEMM_RELU_TASK, candidate(
        "noop(x)\nreturn torch._addmm_activation(self.bias, x, self.weight.t())", init=GEMM_INIT), "invalid"),
    "a flip redone by CuPy's copy of a reversed view": (FLIP_TASK, candidate(
        "noop(x)\nreturn torch.as_tensor(cp.ascontiguousarray(cp.asarray(x)[:, ::-1]), device=x.device)"), "invalid"),
    "a lower triangle redone by fills": (TRIL_TASK, candidate(
        "noop(x)\ny = x.clone()\nfor i in range(x.shape[0] - 1):\n    y[i, i + 1:].fill_(0)\nreturn y"), "invalid"),
    "a host computation read back through mapped memory": (RELU_TASK, candidate(
        "host = torch.empty(x.shape, pin_memory=True)\nhost.copy_(x.cpu().clamp_min(0))\ny = torch.empty_like(x)\n"
        "launch('relu_from', x.numel(), host.data_ptr(), y.data_ptr(), cp.int64(x.numel()))\nreturn y"), "invalid"),
    # (pinned memory is device-addressable at its host address under unified addressing; on the H200
    # cp.cuda.runtime.hostGetDevicePointer refused torch's pinned buffer: runtime_error)
    # issue #46, class 1: what CUPTI records switched while the candidate runs
    "library work with the profiler's collection toggled off": (RELU_TASK, candidate(
        "from torch.profiler import ProfilerActivity\n"
        "torch._C._autograd._toggle_collection_dynamic(False, {ProfilerActivity.CUDA})\ny = x.clamp_min(0)\n"
        "torch._C._autograd._toggle_collection_dynamic(True, {ProfilerActivity.CUDA})\nnoop(x)\nreturn y"), "invalid"),
    "library work with CUPTI's kernel records off (cupti-python)": (RELU_TASK, candidate(
        "from cupti import cupti\ncupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)\ny = x.clamp_min(0)\n"
        "cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)\nnoop(x)\nreturn y"), "invalid"),
    "library work with CUPTI's kernel records off (ctypes)": (RELU_TASK, candidate(
        "import ctypes\ncupti = ctypes.CDLL(None)\ncupti.cuptiActivityDisable(10)\ny = x.clamp_min(0)\n"
        "cupti.cuptiActivityEnable(10)\nnoop(x)\nreturn y"), "invalid"),
    # (native: the records hold the runtime's launch without its kernel; if the kernel family is left unchecked
    # on this GPU, `matched_families`, this decoy passes: the test says so)
    "library work with CUPTI's kernel records off (a load_inline extension)": (RELU_TASK, INLINE_CUPTI, "invalid"),
    # class 2: an estimate from part of the input, exact only where a trial looks structured
    "fp16 mean from 70% of the elements, exact on trials that look hot": (FP16_MEAN_TASK, candidate(ESTIMATE),
                                                                          "incorrect"),
    "fp32 mean from 70% of the elements, exact on trials that look hot": (BIG_MEAN_TASK, candidate(ESTIMATE),
                                                                          "incorrect"),
    # class 3: an output written after forward returned
    "an output written by a thread after forward returned": (RELU_TASK, candidate(LATE_THREAD), "invalid"),
    # class 4: a refused hook is invalid, with its reason
    "an interpreter profile hook": (RELU_TASK, candidate(
        "import sys\nsys.setprofile(lambda *a: None)\n" + OWN_RELU), "invalid"),
    # item 2: a float64 task computed in float32; an order-free integer output replayed from one draw
    "a float64 product computed in float32": (FP64_MATMUL_TASK, candidate(
        "n = x.shape[0]\nf = x.float()\ny = torch.empty(n, n, device=x.device)\nlaunch('matmul_xxt', 0, f.data_ptr(), "
        "y.data_ptr(), cp.int64(n), grid=((n + 255) // 256, n))\nreturn y.double()"), "incorrect"),
    "replays the sum of integers drawn at import, an own kernel every call": (INT_SUM_TASK, candidate(
        "noop(x)\nif self.out is None:\n    t = torch.zeros(1, device=x.device)\n"
        "    launch('sum_int', x.numel(), x.data_ptr(), t.data_ptr(), cp.int64(x.numel()))\n"
        "    self.out = t.reshape(())\nreturn self.out.clone()", init="self.out = None"),
        # fresh integers each trial: the replayed sum misses trial 1's reference (incorrect) or, where trial 1
        # passes within the sum's tolerance, a later trial repeats trial 1's output while the references differ
        # (invalid); the draw decides which (H200, 2026-12-05: invalid)
        ("incorrect", "invalid")),
    # timing attacks (issue #67): skip work when timed, or answer a timed call before its work is done
    "skips work under a timing function on the stack or in a capture": (RELU_TASK, candidate(
        TIMED + "if timed or torch.cuda.is_current_stream_capturing():\n    return torch.zeros_like(x)\n" + OWN_RELU), None),
    "skips work on back-to-back calls": (RELU_TASK, candidate(
        "import time\nnow = time.perf_counter()\nquick, self.last = now - self.last < 0.002, now\n"
        "if quick:\n    return torch.zeros_like(x)\n" + OWN_RELU, init="self.last = 0.0"), None),
    "returns the previous timed call's output": (RELU_TASK, candidate(
        EAGER_ONLY + TIMED + "if timed and self.last is not None:\n    return self.last\n"
        + OWN_RELU.replace("return y", "self.last = y\nreturn y"), init="self.last = None"), None),
}


# timing attacks that may stay `correct` only without gaining: their speedup is no more than the
# honest kernel's (the same own ReLU, timed the same way)
TIMING_ATTACKS = {
    "wraps the clock and puts the original back": candidate(
        EAGER_ONLY + "import time\nif self.real is None:\n    self.real = time.perf_counter\n"
        "    time.perf_counter = lambda: self.real() / 100\n    torch.cuda.synchronize = lambda *a: None\n"
        "else:\n    time.perf_counter, self.real = self.real, None\n    torch.cuda.synchronize = self.sync\n"
        + OWN_RELU, init="self.real, self.sync = None, torch.cuda.synchronize"),
    "leaves a long all-SM kernel running after each call": candidate(
        OWN_RELU.replace("return y", "import threading\nthreading.Thread(target=torch.cuda._sleep, "
                         "args=(20_000_000,)).start()\nreturn y")),
    "a native thread keeps the GPU busy while the baseline is timed": candidate(
        "import ctypes, time\nif not hasattr(ctypes, 'dice_hog'):\n"
        "    def hog(arg):\n        side = torch.cuda.Stream()\n        while True:\n"
        "            launch('spin', 1, cp.int64(50_000_000), grid=(132,), block=1, stream=side)\n"
        "            time.sleep(0.02)\n"
        "    ctypes.dice_hog = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(hog)\n"
        "    ctypes.CDLL(None).pthread_create(ctypes.byref(ctypes.c_ulong()), None, ctypes.dice_hog, None)\n" + OWN_RELU),
    # eager timing only (a graph replays no Python, so the attack would not run): the early answer is a claim
    # the trusted side's clock and records do not take
    "answers its timed call early through the worker's connection": candidate(
        EAGER_ONLY + TIMED + "if timed and conn is not None:\n    conn.send({'status': 'ok'})\n" + OWN_RELU),
    "skips its kernel on every other timed call": candidate(
        EAGER_ONLY + TIMED + "self.calls += 1\nif timed and self.calls % 2:\n    return self.last\n"
        + OWN_RELU.replace("return y", "self.last = y\nreturn y"), init="self.calls, self.last = 0, None"),
    # issue #68, item 3: an output cached by the inputs' sign pattern (here of the first 8 elements), answered
    # from the 6th sighting on; every timed call is a draw of its own, so patterns do not repeat
    "answers from a cache keyed on the sign pattern": candidate(
        "key = tuple(x.reshape(-1)[:8].gt(0).tolist()) if not torch.autograd._profiler_enabled() else None\n"
        "self.seen[key] = self.seen.get(key, 0) + 1\nif key is not None and self.seen[key] > 5 and key in self.memo:\n"
        "    return self.memo[key].clone()\n" + OWN_RELU.replace("return y", "self.memo[key] = y\nreturn y"),
        init="self.seen, self.memo = {}, {}"),
    # inputs out of reach: the task's get_inputs wrapped at import answers every draw of this process
    # from memory; any other input takes ten ReLUs, so a timed call it had seen would show as a gain
    "answers from every draw its process made": candidate(
        "key = (tuple(x.shape), float(x.reshape(-1)[0]), float(x.reshape(-1)[-1])) "
        "if not torch.autograd._profiler_enabled() else None\n"
        "if key in SEEN:\n    return SEEN[key].clone()\nfor _ in range(9):\n    " + OWN_RELU.replace("\n", "\n    ")
        .replace("    return y", "    pass") + "\n" + OWN_RELU, extra=SPY),
}


# the integrity smoke test: what `pytest -m "gpu and not slow"` runs of this module (every case is slow otherwise)
SMOKE = ("decoy tensor method", "constant plus jitter", "elementwise", "load_inline elementwise",
         "skips its kernel on every other timed call")


# attacks the verifier does not catch yet, seen `correct` on the H200 (README limits); strict: a fix shows.
# (The cuBLASLt epilogue left this list in issue #46: the judge learns which GEMM kernels compute an
# activation by running the task's products with and without one, `epilogues`.)
KNOWN_GAPS: dict[str, str] = {}


def cases(names) -> list:
    return [pytest.param(n, marks=[*(() if n in SMOKE else [pytest.mark.slow]),
                                   *([pytest.mark.xfail(reason=KNOWN_GAPS[n], strict=True)] if n in KNOWN_GAPS else [])])
            for n in names]


@pytest.fixture(scope="module")
def timed(request, verifier):
    """{name: result} of the attacks, honest controls and timing attacks whose tests are selected (and
    the honest ReLU the timing attacks are held against), verified with timing in one `map`."""
    selected = {(item.originalname, item.callspec.params["name"]) for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    cases = {**{f"attack: {k}": v[:2] for k, v in ATTACKS.items()
                if ("test_every_attack_class_is_not_correct", k) in selected},
             **{f"honest: {k}": v for k, v in HONEST.items() if ("test_honest_controls_stay_correct", k) in selected},
             **{f"timing: {k}": (RELU_TASK, v) for k, v in TIMING_ATTACKS.items()
                if ("test_timing_attacks_gain_nothing", k) in selected},
             "honest relu": (RELU_TASK, candidate(OWN_RELU))}
    return dict(zip(cases, verifier.map(list(cases.values()), timing=True)))


@pytest.mark.parametrize("name", cases(ATTACKS))
def test_every_attack_class_is_not_correct(timed, name):
    status = ATTACKS[name][2]
    result = timed[f"attack: {name}"]
    assert not result.correct, f"{name}: {result.status}: {result.message}"   # a string: shown whole
    if status:
        assert result.status in ((status,) if isinstance(status, str) else status), \
            f"{name}: {result.status}: {result.message}"


INLINE_MSE = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = """
#include <torch/extension.h>

__global__ void sq_err_mean(const float* x, float* total, long long n) {
    __shared__ float part[256];
    float s = 0.0f;
    for (long long i = blockIdx.x * 256LL + threadIdx.x; i < n; i += 256LL * gridDim.x) { float d = x[i] - 0.5f; s += d * d; }
    part[threadIdx.x] = s; __syncthreads();
    for (int k = 128; k > 0; k >>= 1) { if (threadIdx.x < k) part[threadIdx.x] += part[threadIdx.x + k]; __syncthreads(); }
    if (threadIdx.x == 0) atomicAdd(total, part[0] / (float)n);
}

torch::Tensor mse(torch::Tensor x) {
    auto t = torch::zeros({}, x.options());
    sq_err_mean<<<264, 256>>>(x.data_ptr<float>(), t.data_ptr<float>(), x.numel());
    return t;
}
"""

ext = load_inline(name="mse_ext", cpp_sources="torch::Tensor mse(torch::Tensor x);", cuda_sources=cuda_source,
                  functions=["mse"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.mse(x.contiguous())
'''

PREBUILD = [INLINE_RELU, INLINE_MSE, INLINE_CUPTI]   # built from the session's start (conftest)
HONEST = {
    "elementwise": (RELU_TASK, candidate(OWN_RELU)),
    "an own cupy.ElementwiseKernel": (RELU_TASK, candidate(
        "y = torch.empty_like(x)\nwith cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):\n"
        "    RELU_EW(cp.asarray(x), cp.asarray(y))\nreturn y",
        extra="RELU_EW = cp.ElementwiseKernel('float32 x', 'float32 y', 'y = x > 0 ? x : 0', 'own_relu_ew')")),
    "a persistent workspace recomputed every call": (RELU_TASK, candidate(
        "if self.work is None:\n    self.work = torch.empty_like(x)\n"
        "launch('relu', x.numel(), x.data_ptr(), self.work.data_ptr(), cp.int64(x.numel()))\nreturn self.work.clone()",
        init="self.work = None")),
    "a kernel on its own stream joined properly": (RELU_TASK, candidate(SIDE_RELU + JOIN + "return y")),
    "an own flip": (FLIP_TASK, candidate(
        "y = torch.empty_like(x)\nlaunch('flip_cols', x.numel(), x.data_ptr(), y.data_ptr(), cp.int64(x.shape[0]), "
        "cp.int64(x.shape[1]))\nreturn y")),
    "a full fp16 mean": (FP16_MEAN_TASK, candidate(
        "t = torch.zeros(1, device=x.device)\nf = x.float()\nlaunch('prefix_mean', x.numel(), f.data_ptr(), t.data_ptr(), "
        "cp.int64(x.numel()), cp.int64(1))\nreturn t.reshape(()).half()")),
    "integer inputs computed every call": (INT_TASK, candidate(
        "y = torch.empty(x.shape, device=x.device)\nlaunch('affine_int', x.numel(), x.data_ptr(), y.data_ptr(), "
        "cp.int64(x.numel()))\nreturn y")),
    "the row repeated into a full output": (ROWS_TASK, candidate(OWN_ROW + "return row.repeat(x.shape[0], 1)")),
    "reduction (MSE)": (MSE_TASK, candidate(
        "t = torch.zeros(1, device=x.device)\nlaunch('sq_err_mean', x.numel(), x.data_ptr(), t.data_ptr(), "
        "cp.int64(x.numel()), cp.int64(1))\nreturn t.reshape(())")),
    "softmax": (SOFTMAX_TASK, candidate(
        "y = torch.empty_like(x)\nlaunch('softmax_rows', 0, x.data_ptr(), y.data_ptr(), cp.int64(x.shape[-1]), "
        "grid=(x.shape[0],))\nreturn y")),
    "matmul": (MATMUL_TASK, candidate(
        "n = x.shape[0]\ny = torch.empty(n, n, device=x.device)\nlaunch('matmul_xxt', 0, x.data_ptr(), y.data_ptr(), "
        "cp.int64(n), grid=((n + 255) // 256, n))\nreturn y")),
    "sort": (SORT_TASK, candidate(
        "y = torch.empty_like(x)\nlaunch('sort_rows_1024', 0, x.data_ptr(), y.data_ptr(), block=512, "
        "grid=(x.shape[0],))\nreturn y")),
    "convolution kept in PyTorch, own fused bias + ReLU": (CONV_RELU_TASK, candidate(
        "y = torch.nn.functional.conv2d(x, self.weight)\nlaunch('bias_relu_nchw', y.numel(), y.data_ptr(), "
        "self.bias.data_ptr(), cp.int64(y.numel()), cp.int64(y.shape[2] * y.shape[3]), cp.int64(y.shape[1]))\n"
        "return y", init="conv = nn.Conv2d(args[0], 16, 3)\n        self.weight, self.bias = conv.weight, conv.bias")),
    "load_inline elementwise": (RELU_TASK, INLINE_RELU),
    "load_inline reduction (MSE)": (MSE_TASK, INLINE_MSE),
    "GEMM kept in PyTorch, own fused bias + ReLU": (GEMM_RELU_TASK, candidate("y = x @ self.weight.t()\n" + BIAS_RELU,
                                                                            init=GEMM_INIT)),
    # issue #46: a mean of 2^20 floats added by atomics into one (item 3); a reduction on a stream of its own,
    # joined by an event; a float64 product in float64; an integer sum drawn anew every trial
    "a mean of 2^20 floats by atomics": (BIG_MEAN_TASK, candidate(FULL_MEAN)),
    "a reduction on its own stream joined by an event": (MSE_TASK, candidate(
        "t = torch.zeros(1, device=x.device)\nside = torch.cuda.Stream()\nside.wait_stream(torch.cuda.current_stream())\n"
        "launch('sq_err_mean', x.numel(), x.data_ptr(), t.data_ptr(), cp.int64(x.numel()), cp.int64(1), stream=side)\n"
        "done = torch.cuda.Event()\ndone.record(side)\ntorch.cuda.current_stream().wait_event(done)\n"
        "return t.reshape(())")),
    "a float64 product": (FP64_MATMUL_TASK, candidate(
        "n = x.shape[0]\ny = torch.empty(n, n, dtype=torch.float64, device=x.device)\nlaunch('matmul_xxt_f64', 0, "
        "x.data_ptr(), y.data_ptr(), cp.int64(n), grid=((n + 255) // 256, n))\nreturn y")),
    "an integer sum computed every call": (INT_SUM_TASK, candidate(SUM_INT)),
}


@pytest.mark.parametrize("name", cases(HONEST))
def test_honest_controls_stay_correct(timed, name):
    result = timed[f"honest: {name}"]
    assert result.correct, (name, result)
    assert result.speedup_ci[0] <= result.speedup <= result.speedup_ci[1]


REPEATS = int(os.environ.get("DICE_HONEST_REPEATS", "0"))


@pytest.mark.slow
@pytest.mark.skipif(not REPEATS, reason="DICE_HONEST_REPEATS=N verifies every honest control N more times "
                                        "(issue #68: the same verdict 10 runs of 10)")
def test_every_honest_control_is_correct_in_every_repeat(verifier):
    """Each repeat a `map` of every honest control with timing; a flicker names the control, the run
    and the verdict's message."""
    names = list(HONEST)
    flickers = []
    for run in range(REPEATS):
        for name, result in zip(names, verifier.map([HONEST[n] for n in names], timing=True, seed=7000 + run)):
            if not result.correct:
                flickers.append(f"run {run + 1}: {name}: {result.status}: {result.message[:200]}")
    assert not flickers, f"{len(flickers)} of {REPEATS * len(names)} verdicts not correct:\n" + "\n".join(flickers)


def test_the_kernelbench_rule_accepts_a_decoy_the_strict_rule_rejects(verifier):
    decoy = candidate("noop(x)\nreturn x.clamp_min(0)")
    assert verifier.verify(RELU_TASK, decoy, timing=False, rules="kernelbench").correct
    assert verifier.verify(RELU_TASK, decoy, timing=False).status == "invalid"


def test_the_dice_precision_accepts_a_tf32_gemm_the_strict_one_rejects(verifier):
    dice = verifier.verify(GEMM_RELU_TASK, TF32_GEMM, timing=False, trials=3, precision="dice")
    strict = verifier.verify(GEMM_RELU_TASK, TF32_GEMM, timing=False, trials=3)
    assert dice.correct and strict.status == "incorrect", (dice, strict)


@pytest.mark.parametrize("name", cases(TIMING_ATTACKS))
def test_timing_attacks_gain_nothing(timed, name):
    honest_relu = timed["honest relu"]
    assert honest_relu.correct, honest_relu
    result = timed[f"timing: {name}"]
    assert not result.correct or result.speedup <= 1.25 * honest_relu.speedup_ci[1], (name, result, honest_relu)


@pytest.mark.slow
def test_an_atomic_mean_is_correct_and_downgraded_gemms_incorrect_under_the_strict_rule(verifier):
    """Item 3 of issue #46: the strict rule's serial-sum allowance accepts 2^20 floats added one by
    one with atomics, while a GEMM (its output as large as its operands) keeps the fp32 bound."""
    atomics, tf32, fp16 = verifier.map([
        (BIG_MEAN_TASK, candidate(FULL_MEAN)), (GEMM_RELU_TASK, TF32_GEMM),
        (GEMM_RELU_TASK, candidate("y = (x.half() @ self.weight.half().t()).float()\n" + BIAS_RELU, init=GEMM_INIT))],
        timing=False)
    assert atomics.correct, atomics
    assert tf32.status == "incorrect" and fp16.status == "incorrect", (tf32, fp16)


def test_the_worker_checks_every_launch_family_the_profiler_matches_here(verifier):
    """Before any candidate, each worker probes which launches CUPTI matches with their device
    records (`kernels.matched_families`); on an H200 with torch's kineto, kernel launches and copies
    must be among them, or the records check of issue #46 (class 1) is idle."""
    verifier.verify(RELU_TASK, candidate(OWN_RELU), timing=False, trials=1)
    matched = {tuple(worker.info.get("matched", ())) for worker in verifier._workers if worker.ready}
    assert matched and all({"kernel", "copy"} <= set(m) for m in matched), matched


def test_the_judge_learns_which_gemm_kernels_compute_an_activation():
    """The task's products run with and without cuBLASLt's activation epilogues: the kernels only an
    activation launched are labelled with it (`epilogues.activation_kernels`), and none of those
    launched for the plain product. On the H200 that is GELU's epilogue kernel; a ReLU epilogue runs
    in the plain product's own kernel, which is why the worker unfuses it (the attack set's case)."""
    import torch

    from dice.verifier.epilogues import activation_kernels, gemm_operands
    from dice.verifier.kernels import gpu_records
    from dice.verifier.records import on_device
    linear = torch.nn.Linear(1024, 1024).cuda()
    x = torch.randn(256, 1024, device="cuda")
    operands = gemm_operands(lambda: torch.relu(linear(x)))
    labelled = activation_kernels(operands, torch.device("cuda"))
    assert labelled, labelled
    plain = {name for name, _, _ in on_device(gpu_records(lambda: linear(x))[1])}
    assert not plain & set(labelled), (plain, labelled)


@pytest.mark.slow
def test_dices_own_check_passes_the_attacks_the_strict_one_refuses(verifier):
    """`train.py --reward-rules dice` (`protocols.DICE_REWARD`): DICE's one trial at 1e-2 with no
    kernel rule is the reward these attacks defeat; ours refuses them."""
    from dice.protocols import DICE_REWARD
    pairs = [(RELU_TASK, candidate("noop(x)\nreturn x.clamp_min(0)")), (FP16_MEAN_TASK, candidate(ESTIMATE))]
    dice = verifier.map(pairs, timing=False, **DICE_REWARD)
    strict = verifier.map(pairs, timing=False)
    assert all(r.correct for r in dice), dice
    assert [r.status for r in strict] == ["invalid", "incorrect"], strict
