"""The fast load_inline build on a GPU: through the Verifier it gives torch's verdict on correct,
incorrect, compile-broken, crashing and unsplittable programs, and a BuildPool prebuild is what the
workers then load. Run with `pytest -m gpu tests/test_inline_build_gpu.py`; torch's own builds (about
a minute of CPU each, prebuilt from the session's start: tests/conftest.py) are the slow test."""
import os

import pytest

from dice.verifier import Verifier

pytestmark = pytest.mark.gpu

TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x * 2.0 + 1.0)


def get_inputs():
    return [torch.randn(1000, 999)]


def get_init_inputs():
    return []
'''

CANDIDATE = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#define THREADS 256
struct Affine { float scale, shift; };

__device__ __forceinline__ float relu(float v) { return v > 0.0f ? v : 0.0f; }

__global__ void affine_relu(const float* __restrict__ x, float* y, Affine a, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = relu(a.scale * x[i] + a.shift)BODY;
}

__global__ void copy(const float* x, float* y, int64_t n) {
    extern __shared__ float tile[];
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    tile[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    if (i < n) y[i] = tile[threadIdx.x];
}

torch::Tensor run(torch::Tensor x) {
    auto xc = x.contiguous();
    auto tmp = torch::empty_like(xc);
    auto y = torch::empty_like(xc);
    int64_t n = xc.numel();
    int blocks = (n + THREADS - 1) / THREADS;
    affine_relu<<<blocks, THREADS>>>(xc.data_ptr<float>(), tmp.data_ptr<float>(), Affine{2.0f, 1.0f}, n);
    copy<<<blocks, THREADS, THREADS * sizeof(float), at::cuda::getCurrentCUDAStream()>>>(
        tmp.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

ext = load_inline(name="affine_relu", cpp_sources="CPP", cuda_sources=cuda_source, functions=["run"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.run(x)
'''

PROGRAMS = {
    "correct": ({}, "correct"),
    "incorrect": ({"BODY": " * 0.5f"}, "incorrect"),
    "kernel does not compile": ({"BODY": " + undefined_name"}, "compile_error"),
    "cpp_sources do not compile": ({"CPP": "torch::Tensr run(torch::Tensor x);"}, "compile_error"),
    "crashes": ({"BODY": "; y[i + (1ll << 40)] = 1.0f"}, "runtime_error"),
    "templated kernel (torch's build)": ({"__global__ void copy(": "template <typename T> __global__ void copy_t(T* p) {}\n"
                                          "__global__ void copy("}, "correct"),
}


def program(edits: dict) -> str:
    text = CANDIDATE.replace("BODY", edits.get("BODY", "")).replace('"CPP"', repr(
        edits.get("CPP", "torch::Tensor run(torch::Tensor x);")))
    for old, new in edits.items():
        if old not in ("BODY", "CPP"):
            text = text.replace(old, new)
    return text


FAST_WAY = [name for name in PROGRAMS if "torch's build" not in name]   # the rest need torch's load_inline
TEMPLATED = "templated kernel (torch's build)"
# torch's own build decides these as the fast build did: a build that runs (torch's binding against the
# generic one) and the two compile errors the fast build reports as torch's without running torch's build
# (`fast.SharedCompileError`: a name declared nowhere in cuda_sources, an error in torch's main.cpp)
TORCH_WAY = ["correct", "kernel does not compile", "cpp_sources do not compile"]
PREBUILD = [program(PROGRAMS[name][0]) for name in FAST_WAY]   # built from the session's start (conftest)
BUILDS_TORCH_WAY = True    # run after the other GPU tests (conftest), when the builds are done


@pytest.fixture(scope="module")
def fast_verdicts(verifier):
    """The session pool's verdicts (the fast build, DESIGN.md §8.5) on the programs it builds its
    own way, in one map: {name: result}."""
    results = verifier.map([(TASK, program(PROGRAMS[name][0])) for name in FAST_WAY], timing=False, trials=2)
    return dict(zip(FAST_WAY, results))


def test_fast_build_gives_the_expected_verdicts(fast_verdicts):
    for name in FAST_WAY:
        assert fast_verdicts[name].status == PROGRAMS[name][1], (name, fast_verdicts[name].message)


@pytest.mark.slow
@pytest.mark.prebuild(program(PROGRAMS[TEMPLATED][0]))     # the fast way: the split refuses it, torch's builds it
@pytest.mark.prebuild(*(program(PROGRAMS[name][0]) for name in TORCH_WAY), build="torch")
def test_torchs_build_gives_the_fast_builds_verdicts(verifier, fast_verdicts, torch_build_cache, prebuilt_programs):
    """torch's own load_inline (about a minute of CPU per program, prebuilt from the session's start):
    the fast build gives a program the split refuses to it (the prebuild's report says so), which
    decides its verdict; and torch's build of TORCH_WAY decides as the fast build did. (The
    incorrect and crashing programs differ from the correct one only in a kernel's body, which both
    builds compile with the same nvcc flags: their verdicts are the fast build's in the test above.)"""
    templated = program(PROGRAMS[TEMPLATED][0])
    report = prebuilt_programs.reports("fast")[templated].result()     # the session's prebuild of it
    assert [b["how"] for b in report["builds"]] == ["torch"], report
    assert report["builds"][0]["reason"].startswith("split refused: templated kernel"), report
    fallback = verifier.verify(TASK, templated, timing=False, trials=2)
    assert fallback.status == PROGRAMS[TEMPLATED][1], fallback.message
    with Verifier(workers=len(TORCH_WAY), cache_dir=torch_build_cache, build="torch", prebuild=False) as torch_way:
        results = torch_way.map([(TASK, program(PROGRAMS[name][0])) for name in TORCH_WAY], timing=False, trials=2)
    for name, slow in zip(TORCH_WAY, results):
        fast = fast_verdicts[name]
        assert fast.status == slow.status == PROGRAMS[name][1], (name, fast.message, slow.message)


def test_a_prebuild_is_the_fast_way_on_the_precompiled_header(verifier, prebuilt_programs):
    """A BuildPool prebuild (the session's pool) builds the fast way, with the generic binding on
    the precompiled header, and the program verifies. (The Verifier prebuilds each candidate into
    a folder of its own, which its worker then loads: `Verifier._verify_one`; a build shared
    between candidates is never loaded, DESIGN.md §8.4.)"""
    candidate = program({"affine_relu": "affine_relu_prebuilt"})
    report = prebuilt_programs.pools["fast"].submit(candidate).result()
    build = report["builds"][0] if report.get("builds") else {}
    assert report["status"] == "built" and build.get("how") == "fast", report
    assert build["dispatcher"] and build["pch"], report   # the generic binding, on the precompiled header
    assert verifier.verify(TASK, candidate, timing=False, trials=2).status == "correct"
