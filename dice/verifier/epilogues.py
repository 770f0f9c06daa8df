"""Library GEMMs that would compute an activation in their epilogue (DESIGN.md §8.1): learnt from
the task's own GEMMs in the judge, and unfused in the candidate's worker.

cuBLASLt fuses a bias and a ReLU or GELU into a GEMM's epilogue (`torch._addmm_activation`), and
its kernels' names (nvjet on Hopper) need not show it: a candidate could leave the task's
activation to the library GEMM while its own kernel does nothing. So what a GEMM kernel computes
is read from what launches it, not from its name: on operands of the shapes, dtypes and strides of
every product the reference computes (`gemm_operands`), in each layout of its operands, the judge
runs the plain product, the product with a bias, and the product with a bias and each activation,
and records their kernels (`activation_kernels`). A GEMM kernel launched only with an activation
computes it; `rules.kernel_problem` classes its launches "gemm+<activation>", which no reference
GEMM without that activation covers, so it is library compute the reference does not run.

On the H200 (cuBLASLt of CUDA 13) a ReLU epilogue runs in the very nvjet kernel the plain product
runs: no name tells them apart. So in the candidate's worker torch's entry point to those epilogues,
`aten::_addmm_activation`, is replaced before any candidate code runs (`unfuse_activations`) by the
product with a bias followed by the activation as its own kernel, as aten computes it where
cuBLASLt does not (`addmm_out_cuda_impl`'s unfused path: `relu_`, `gelu_` with the tanh estimate).
The result is the same; the activation becomes a launch of its own that the kernel rule classes,
from Python and from compiled code alike (both call through the dispatcher). A compiled extension
that calls cuBLASLt itself is beyond this (README, limits).
"""
from __future__ import annotations

import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import records
from .kernels import gpu_records
from .rules import kernel_class, trusted

aten = torch.ops.aten
# the products and where their two matrix operands are among the arguments
PRODUCTS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten._addmm_activation.default: (1, 2)}
ACTIVATIONS = {"relu": False, "gelu": True}     # name -> torch._addmm_activation's use_gelu


_UNFUSED = []    # the torch.library registration, alive as long as the worker


def unfuse_activations(device_type: str = "cuda") -> None:
    """In this process, torch._addmm_activation on `device_type` computes its product and its
    activation as two kernels (module docstring); call once, before candidate code runs."""
    if _UNFUSED:
        return
    library = torch.library.Library("aten", "IMPL")

    def addmm_then_activation(bias, a, b, *, beta=1, alpha=1, use_gelu=False):
        out = aten.addmm.default(bias, a, b, beta=beta, alpha=alpha)
        return aten.gelu_.default(out, approximate="tanh") if use_gelu else aten.relu_.default(out)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")   # replacing aten's kernel is the point
        library.impl("_addmm_activation", addmm_then_activation, device_type.upper())
    _UNFUSED.append(library)


class _Products(TorchDispatchMode):
    """Notes (shape, stride, dtype) of both operands of every 2-D product that runs under it."""

    def __init__(self):
        super().__init__()
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in PRODUCTS:
            a, b = (args[i] for i in PRODUCTS[func])
            self.seen.add(tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in (a, b)))
        return func(*args, **(kwargs or {}))


def gemm_operands(forward) -> set:
    """The operand layouts of the 2-D products `forward()` computes (mm, addmm, linear)."""
    mode = _Products()
    with trusted.no_grad(), mode:
        forward()
    return mode.seen


def _layouts(shape: tuple, stride: tuple) -> set:
    """The operand's own strides, row-major and column-major."""
    rows, cols = shape
    return {stride, (cols, 1), (1, rows)}


def activation_kernels(operands: set, device: torch.device) -> dict[str, list[str]]:
    """{GEMM kernel name: the activations it was launched with} for the kernels that ran with an
    activation epilogue on these operands (in each layout) and never without one; one profiled
    session per variant (plain products and products with a bias; each activation)."""
    if not operands:
        return {}
    plain = _gemm_names(operands, device, lambda a, b, bias: (torch.mm(a, b), torch.addmm(bias, a, b)))
    found: dict[str, list[str]] = {}
    for name, gelu in ACTIVATIONS.items():
        epilogue = _gemm_names(operands, device, lambda a, b, bias: torch._addmm_activation(bias, a, b, use_gelu=gelu))
        for kernel in sorted(epilogue - plain):
            found.setdefault(kernel, []).append(name)
    return found


def _gemm_names(operands: set, device: torch.device, product) -> set:
    """The GEMM-class kernels `product(a, b, bias)` launches on every operand pair, in every layout."""
    def run():
        for (a_shape, a_stride, dtype), (b_shape, b_stride, _) in operands:
            for sa in _layouts(a_shape, a_stride):
                for sb in _layouts(b_shape, b_stride):
                    a = torch.empty_strided(a_shape, sa, dtype=dtype, device=device).normal_()
                    b = torch.empty_strided(b_shape, sb, dtype=dtype, device=device).normal_()
                    product(a, b, torch.zeros(b_shape[1], dtype=dtype, device=device))
    return {name for name, _, _ in records.on_device(gpu_records(run)[1]) if kernel_class(name).startswith("gemm")}
