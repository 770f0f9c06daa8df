"""Do speedups repeat? `python -m dice.bench stability` (GPU; issue 26, DESIGN.md §8.3).

Honest CuPy candidates, each verified with timing by `--verifiers` fresh `Verifier`s in turn (new
worker and judge processes, a new build cache, nothing kept between them), on one machine. Per
candidate it prints the candidate's and the eager baseline's median ms, each verifier's speedup,
the largest over the smallest, the widest 95% interval and the timing method. Issue 26's target:
max/min <= 1.05 for kernels of 50 us or more.
"""
from __future__ import annotations

import statistics
import tempfile

from ..cli import at_least
from ..verifier import Verifier

KERNELS = r'''
extern "C" __global__ void relu(const float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}
extern "C" __global__ void bias_relu(float* y, const float* b, long long n, long long cols) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) { float v = y[i] + b[i % cols]; y[i] = v > 0.0f ? v : 0.0f; }
}
extern "C" __global__ void softmax_rows(const float* x, float* y, long long cols) {
    __shared__ float red[256];
    const float* xr = x + blockIdx.x * cols; float* yr = y + blockIdx.x * cols;
    float m = -1e30f, sum = 0.0f;
    for (long long j = threadIdx.x; j < cols; j += 256) m = fmaxf(m, xr[j]);
    red[threadIdx.x] = m; __syncthreads();
    for (int s = 128; s > 0; s >>= 1) { if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]); __syncthreads(); }
    m = red[0]; __syncthreads();
    for (long long j = threadIdx.x; j < cols; j += 256) sum += expf(xr[j] - m);
    red[threadIdx.x] = sum; __syncthreads();
    for (int s = 128; s > 0; s >>= 1) { if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s]; __syncthreads(); }
    for (long long j = threadIdx.x; j < cols; j += 256) yr[j] = expf(xr[j] - m) / red[0];
}
extern "C" __global__ void matmul_xxt(const float* x, float* y, long long n) {
    long long r = blockIdx.y, c = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (c < n) { float s = 0.0f; for (long long k = 0; k < n; ++k) s += x[r * n + k] * x[c * n + k]; y[r * n + c] = s; }
}
extern "C" __global__ void row_sum(const float* x, float* y, long long cols) {
    __shared__ float red[256];
    const float* xr = x + blockIdx.x * cols;
    float s = 0.0f;
    for (long long j = threadIdx.x; j < cols; j += 256) s += xr[j];
    red[threadIdx.x] = s; __syncthreads();
    for (int k = 128; k > 0; k >>= 1) { if (threadIdx.x < k) red[threadIdx.x] += red[threadIdx.x + k]; __syncthreads(); }
    if (threadIdx.x == 0) y[blockIdx.x] = red[0];
}
'''

HEADER = f'''import cupy as cp
import torch
import torch.nn as nn

_module = cp.RawModule(code=r"""{KERNELS}""")


def launch(name, grid, *args):
    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        _module.get_function(name)(grid, (256,), args)


class ModelNew(nn.Module):
    def __init__(self, *args):
        super().__init__()
INIT

    def forward(self, x):
FORWARD
'''


def _task(forward: str, inputs: str, init: str = "", init_inputs: str = "[]") -> str:
    return (f"import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self, *args):\n"
            f"        super().__init__()\n{init or '        pass'}\n\n    def forward(self, x):\n        return {forward}\n"
            f"\n\ndef get_inputs():\n    return [{inputs}]\n\n\ndef get_init_inputs():\n    return {init_inputs}\n")


def _candidate(forward: str, init: str = "        pass") -> str:
    body = "\n".join("        " + line for line in forward.strip().splitlines())
    return HEADER.replace("INIT", init, 1).replace("FORWARD", body, 1)


ELEMENTWISE = "y = torch.empty_like(x)\nn = x.numel()\nlaunch('relu', ((n + 255) // 256,), x.data_ptr(), y.data_ptr(), cp.int64(n))\nreturn y"
LINEAR = "        self.linear = nn.Linear(args[0], args[0])"
CASES = {   # name: (task, candidate)
    "relu 8192x8192": (_task("torch.relu(x)", "torch.randn(8192, 8192)"), _candidate(ELEMENTWISE)),
    "softmax 4096x8192": (_task("torch.softmax(x, dim=-1)", "torch.randn(4096, 8192)"), _candidate(
        "y = torch.empty_like(x)\nlaunch('softmax_rows', (x.shape[0],), x.data_ptr(), y.data_ptr(), cp.int64(x.shape[1]))"
        "\nreturn y")),
    "row sum 8192x4096": (_task("x.sum(dim=-1)", "torch.randn(8192, 4096)"), _candidate(
        "y = torch.empty(x.shape[0], device=x.device)\nlaunch('row_sum', (x.shape[0],), x.data_ptr(), y.data_ptr(), "
        "cp.int64(x.shape[1]))\nreturn y")),
    "matmul x @ x.T 512": (_task("x @ x.t()", "torch.randn(512, 512)"), _candidate(
        "n = x.shape[0]\ny = torch.empty(n, n, device=x.device)\nlaunch('matmul_xxt', ((n + 255) // 256, n), x.data_ptr(), "
        "y.data_ptr(), cp.int64(n))\nreturn y")),
    "linear 4096 + own bias/relu": (_task("torch.relu(self.linear(x))", "torch.randn(2048, 4096)", LINEAR, "[4096]"),
                                    _candidate("y = x @ self.linear.weight.t()\nlaunch('bias_relu', ((y.numel() + 255) "
                                               "// 256,), y.data_ptr(), self.linear.bias.data_ptr(), cp.int64(y.numel()), "
                                               "cp.int64(y.shape[1]))\nreturn y", LINEAR)),
    "relu 256x1024 (short)": (_task("torch.relu(x)", "torch.randn(256, 1024)"), _candidate(ELEMENTWISE)),
    "softmax 64x1024 (short)": (_task("torch.softmax(x, dim=-1)", "torch.randn(64, 1024)"), _candidate(
        "y = torch.empty_like(x)\nlaunch('softmax_rows', (x.shape[0],), x.data_ptr(), y.data_ptr(), cp.int64(x.shape[1]))"
        "\nreturn y")),
}


def bench_stability(args, bench) -> None:
    """Each candidate's speedup from every fresh Verifier; the budget stops between Verifiers (a
    Verifier's candidates cut short keep what finished), and the rows then cover the Verifiers run."""
    names = list(CASES)
    runs = {name: [] for name in names}
    try:
        for v in range(args.verifiers):
            bench.check(f"verifiers {v + 1}..{args.verifiers}")
            with tempfile.TemporaryDirectory(prefix="dice-stability-") as cache, \
                    Verifier(workers=args.workers, cache_dir=cache) as verifier:
                results, _, _ = bench.verify_map(verifier, [CASES[n] for n in names],
                                                 f"verifier {v + 1}/{args.verifiers}")
            for name, result in zip(names, results):
                if result is not None:
                    runs[name].append(result)
            # each Verifier's speedups in the log as they come: a run cut short before its table keeps them
            bench.progress(f"verifier {v + 1}/{args.verifiers} speedups: " + ", ".join(
                f"{n} {r.speedup:.3f}x" if r is not None and r.correct else f"{n} {r.status if r else '-'}"
                for n, r in zip(names, results)), force=True)
    finally:
        for name in names:
            bench.row(_stability_row(name, runs[name]), partial=len(runs[name]) < args.verifiers)


def _stability_row(name: str, results: list) -> dict:
    if not results or not all(r.correct for r in results):
        return {"candidate": name, "ms": "-", "eager ms": "-", "speedups": " ".join(r.status for r in results),
                "max/min": "-", "widest CI": "-", "method": "-"}
    speedups = [r.speedup for r in results]
    return {"candidate": name, "ms": f"{statistics.median(r.runtime_ms for r in results):.4f}",
            "eager ms": f"{statistics.median(r.baseline_ms for r in results):.4f}",
            "speedups": " ".join(f"{s:.3f}" for s in speedups), "max/min": f"{max(speedups) / min(speedups):.3f}",
            "widest CI": f"+-{100 * max((r.speedup_ci[1] - r.speedup_ci[0]) / 2 / r.speedup for r in results):.1f}%",
            "method": "/".join(sorted({r.timing for r in results}))}


def add_arguments(p) -> None:
    p.add_argument("--verifiers", type=at_least(1), default=4, help="fresh Verifiers, one after another")
    p.add_argument("--workers", type=at_least(1), default=2, help="worker processes of each Verifier")
