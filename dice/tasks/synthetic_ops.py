"""The synthetic curriculum's ops (`dice.taskgen`): for each, its PyTorch line, the CUDA line that
mirrors it and the constants a task draws for it. Level-1 tasks are one ELEMENTWISE op, level 2 one
ROW_OPS reduction along the last dimension (its kernel one thread block per row, ROW_HELPERS its
block-wide reductions), level 3 a chain of them."""

from __future__ import annotations

import random

# name -> (torch statement on x, CUDA statement on v, constant kinds); {a}/{lo}/{hi} are constants
ELEMENTWISE = {
    "relu": ("x = torch.relu(x)", "v = fmaxf(v, 0.0f);", ""),
    "leaky_relu": ("x = torch.nn.functional.leaky_relu(x, {a})", "v = v > 0.0f ? v : v * {a}f;", "slope"),
    "sigmoid": ("x = torch.sigmoid(x)", "v = 1.0f / (1.0f + expf(-v));", ""),
    "tanh": ("x = torch.tanh(x)", "v = tanhf(v);", ""),
    "gelu": ("x = torch.nn.functional.gelu(x)", "v = 0.5f * v * (1.0f + erff(v * 0.70710678f));", ""),
    "silu": ("x = torch.nn.functional.silu(x)", "v = v / (1.0f + expf(-v));", ""),
    "softplus": ("x = torch.nn.functional.softplus(x)", "v = v > 20.0f ? v : log1pf(expf(v));", ""),
    "elu": ("x = torch.nn.functional.elu(x, alpha={a})", "v = v > 0.0f ? v : {a}f * (expf(v) - 1.0f);", "alpha"),
    "hardtanh": ("x = torch.nn.functional.hardtanh(x, min_val={lo}, max_val={hi})",
                 "v = fminf(fmaxf(v, {lo}f), {hi}f);", "range"),
    "hardsigmoid": ("x = torch.nn.functional.hardsigmoid(x)", "v = fminf(fmaxf(v / 6.0f + 0.5f, 0.0f), 1.0f);", ""),
    "abs": ("x = torch.abs(x)", "v = fabsf(v);", ""),
    "square": ("x = x * x", "v = v * v;", ""),
    "scale": ("x = x * {a}", "v = v * {a}f;", "scale"),
    "shift": ("x = x + {a}", "v = v + {a}f;", "shift"),
    "clamp": ("x = torch.clamp(x, min={lo}, max={hi})", "v = fminf(fmaxf(v, {lo}f), {hi}f);", "range"),
}

# name -> (torch statements on x, output keeps the row shape?, CUDA body over a row)
ROW_OPS = {
    "sum": ("x = torch.sum(x, dim=-1)", False, "float s = block_sum(acc_sum(xr, cols), buf);\n"
            "    if (threadIdx.x == 0) y[row] = s;"),
    "mean": ("x = torch.mean(x, dim=-1)", False, "float s = block_sum(acc_sum(xr, cols), buf);\n"
             "    if (threadIdx.x == 0) y[row] = s / cols;"),
    "max": ("x = torch.amax(x, dim=-1)", False, "float m = block_max(acc_max(xr, cols), buf);\n"
            "    if (threadIdx.x == 0) y[row] = m;"),
    "softmax": ("x = torch.softmax(x, dim=-1)", True,
                "float m = block_max(acc_max(xr, cols), buf);\n"
                "    float s = block_sum(acc_exp_sum(xr, cols, m), buf);\n"
                "    for (int j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = expf(pre(xr[j]) - m) / s;"),
    "log_softmax": ("x = torch.log_softmax(x, dim=-1)", True,
                    "float m = block_max(acc_max(xr, cols), buf);\n"
                    "    float s = block_sum(acc_exp_sum(xr, cols, m), buf);\n"
                    "    for (int j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = pre(xr[j]) - m - logf(s);"),
    "logsumexp": ("x = torch.logsumexp(x, dim=-1)", False,
                  "float m = block_max(acc_max(xr, cols), buf);\n"
                  "    float s = block_sum(acc_exp_sum(xr, cols, m), buf);\n"
                  "    if (threadIdx.x == 0) y[row] = m + logf(s);"),
    "rmsnorm": ("x = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6)", True,
                "float ss = block_sum(acc_sq_sum(xr, cols), buf);\n"
                "    float r = rsqrtf(ss / cols + 1e-6f);\n"
                "    for (int j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = pre(xr[j]) * r;"),
    "l2_normalize": ("x = torch.nn.functional.normalize(x, dim=-1)", True,
                     "float ss = block_sum(acc_sq_sum(xr, cols), buf);\n"
                     "    float r = 1.0f / fmaxf(sqrtf(ss), 1e-12f);\n"
                     "    for (int j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = pre(xr[j]) * r;"),
    "layer_norm": ("x = torch.nn.functional.layer_norm(x, (x.shape[-1],))", True,
                   "float mu = block_sum(acc_sum(xr, cols), buf) / cols;\n"
                   "    float var = block_sum(acc_dev_sum(xr, cols, mu), buf) / cols;\n"
                   "    float r = rsqrtf(var + 1e-5f);\n"
                   "    for (int j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = (pre(xr[j]) - mu) * r;"),
}

# CUDA helpers of the row kernels; a solution carries only those its row op uses
ROW_HELPERS = {
    "block_sum": r"""
__device__ float block_sum(float v, float* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    float r = buf[0];
    __syncthreads();
    return r;
}
""",
    "block_max": r"""
__device__ float block_max(float v, float* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] = fmaxf(buf[threadIdx.x], buf[threadIdx.x + s]);
        __syncthreads();
    }
    float r = buf[0];
    __syncthreads();
    return r;
}
""",
    "acc_sum": r"""
__device__ float acc_sum(const float* xr, int cols) {
    float a = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) a += pre(xr[j]);
    return a;
}
""",
    "acc_max": r"""
__device__ float acc_max(const float* xr, int cols) {
    float a = __int_as_float(0xff800000);  // -inf
    for (int j = threadIdx.x; j < cols; j += blockDim.x) a = fmaxf(a, pre(xr[j]));
    return a;
}
""",
    "acc_exp_sum": r"""
__device__ float acc_exp_sum(const float* xr, int cols, float m) {
    float a = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) a += expf(pre(xr[j]) - m);
    return a;
}
""",
    "acc_sq_sum": r"""
__device__ float acc_sq_sum(const float* xr, int cols) {
    float a = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = pre(xr[j]);
        a += v * v;
    }
    return a;
}
""",
    "acc_dev_sum": r"""
__device__ float acc_dev_sum(const float* xr, int cols, float mu) {
    float a = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        float d = pre(xr[j]) - mu;
        a += d * d;
    }
    return a;
}
""",
}

PREFIX = "import torch\nimport torch.nn as nn\nimport cupy as cp\n\n"


def draw_constants(kind: str, rng: random.Random, wide: bool = False) -> dict:
    """An op's constants: from a few values each (`wide` False, the curriculum of dice-tiny), or
    drawn from wide ranges to 3 significant digits (`draw_wide`)."""
    if wide:
        return draw_wide(kind, rng)
    if kind == "slope":
        return {"a": rng.choice([0.01, 0.02, 0.05, 0.1, 0.2, 0.3])}
    if kind == "alpha":
        return {"a": rng.choice([0.5, 1.0, 1.5, 2.0])}
    if kind == "scale":
        return {"a": rng.choice([0.125, 0.25, 0.5, 1.5, 2.0, 3.0, -1.0, -0.5])}
    if kind == "shift":
        return {"a": rng.choice([-2.0, -1.0, -0.5, 0.25, 0.5, 1.0, 3.0])}
    if kind == "range":
        lo = rng.choice([-3.0, -2.0, -1.0, -0.5, 0.0])
        return {"lo": lo, "hi": lo + rng.choice([0.5, 1.0, 2.0, 4.0])}
    return {}


def draw_wide(kind: str, rng: random.Random) -> dict:
    """Constants no model can recall, only copy (issue #65): each drawn per task from a wide range
    and written with 3 significant digits; a scale keeps away from 1 and a shift from 0 (where the
    op would be a no-op to the verifier's tolerance), a range is at least 0.25 wide."""
    def sig3(v: float) -> float:
        return float(f"{v:.3g}")

    if kind == "slope":
        return {"a": sig3(rng.uniform(0.01, 0.5))}
    if kind == "alpha":
        return {"a": sig3(rng.uniform(0.2, 3.0))}
    if kind in ("scale", "shift"):
        low = 0.1 if kind == "scale" else 0.05
        while True:
            a = sig3(rng.choice([-1, 1]) * rng.uniform(low, 4.0))
            if kind == "shift" or abs(a - 1.0) >= 0.05:
                return {"a": a}
    if kind == "range":
        lo = sig3(rng.uniform(-4.0, 0.5))
        return {"lo": lo, "hi": sig3(lo + rng.uniform(0.25, 5.0))}
    return {}
