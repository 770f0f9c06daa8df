"""The precision rule: how close a candidate's outputs must be to the reference's (DESIGN.md §8.2).

`VerifyOptions.precision` picks one of
- "strict" (the default, the RL reward): a float32, float64 or complex task is computed in that
  precision. Judge and worker run torch with TF32 off (`math_flags`: cuBLAS and cuDNN would
  otherwise round fp32 operands to TF32, and a convolution kept in PyTorch would differ from a
  true fp32 reference). Each output of such a dtype (complex ones by their component dtype, real
  and imaginary parts alike) is held to its own precision, in units of its unit roundoff u
  (`unit`; float32 2^-24, float64 2^-53): allclose at atol = rtol = 1e-4 x u / u_fp32 (KernelBench
  main's fp32 tolerance, ScalingIntelligence/KernelBench `src/kernelbench/eval.py`,
  `get_tolerance_for_precision`, so 1.9e-13 for float64) and a whole-output relative error of
  REL_L2 = 1e-3 x u / u_fp32, each loosened, never above DICE's 1e-2, by what the reference's
  own float64-measured error shows an honest kernel may need:
  * atol and rel_l2 to SCALE times the reference's own rounding error (`own_error`: a float32
    output against the same Model run in float64 on the same inputs; a float64 output from the
    Model run in float32, times 2^-29: the computation's conditioning in float64's units), for a
    long cumsum near its zero crossings or a sum with cancellation;
  * for a float64 output, rel_l2 to the relative error of an output off by atol everywhere
    (garbage below an atol of ~1e-12 buys nothing), and its own error the loosest of the task's
    trials (the judge: float32's rounding saturates on values far below its unit);
  * rtol and rel_l2 to s (m - 1) u for an output each of whose elements summarises m input
    elements (`reduction_terms`: the largest input's elements over the output's). torch sums in a
    tree (error ~u log m); an honest kernel may add the m terms one by one into one float
    (atomics), whose first-order worst case is (m - 1) u of the terms' absolute sum. On a trial
    whose inputs an element dominates (`harness.DOMINATED_KINDS`: the hot element, the heavy one)
    the running sum starts large, and every term below half a unit of it is lost: the loss is the
    rest's share of the sum, up to that worst case (a mean of 2^17 values on the hot trial: 2^-8;
    of 2^18 on a spiked one: 0.5%; `tests/test_verifier_integrity.py` adds 2^14 to 2^20 floats one
    by one in random orders): s = SERIAL_DOMINATED = 1 there, the bound itself. On the other trials
    the rounding errors of comparable terms add as a random walk (~u sqrt(m) / 3), and s = SERIAL
    = 1/8. The estimates those trials exist to catch miss by tens of percent, and every bound
    stops at 1e-2. A GEMM's output is as large as its operands (m = 1 here), so a TF32 or fp16
    GEMM (errors ~4e-4 of the output's scale, hundreds of times a true fp32 GEMM's) still fails the
    elementwise 1e-4.
  fp16 and bf16 outputs: 1e-2, as KernelBench main.
- "dice": 1e-2 for every dtype with torch's default math flags, as DICE's fork of KernelBench
  (`evaluate.py --protocol dice`), where TF32 and fp16 downgrades of an fp32 task pass.
Explicit `atol`, `rtol` or `rel_l2` options replace the rule's values for every output.
"""
from __future__ import annotations

import torch

PRECISIONS = ("strict", "dice")
FP32_TOLERANCE = 1e-4      # KernelBench main's fp32 atol and rtol
REL_L2 = 1e-3              # the whole-output relative error an exact-precision output may have
DICE_TOLERANCE = 1e-2      # DICE's (and KernelBench main's for fp16 / bf16)
SCALE = 8.0                # times the reference's own fp32 error: an honest kernel's rounding differs by ~1-3x
SERIAL = 1 / 8             # of (m - 1) u, the worst rounding of a sum of m terms added one by one (`tolerances`)
SERIAL_DOMINATED = 1.0     # the same on a trial one element dominates: the terms below its half unit are lost
EXACT = {torch.float32: torch.float32, torch.float64: torch.float64,   # the strict rule's dtypes, by component
         torch.complex64: torch.float32, torch.complex128: torch.float64}


def math_flags(precision: str) -> None:
    """torch's TF32 switches for this precision: off under "strict"; torch's defaults under "dice"
    (cuBLAS without TF32, cuDNN with it)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = precision != "strict"


def is_exact_float(t: torch.Tensor) -> bool:
    """Whether the strict rule holds `t` to its own precision (float32, float64 and the complex
    types built from them)."""
    return t.dtype in EXACT


def unit(dtype: torch.dtype) -> float:
    """The unit roundoff of a floating (or complex: its component's) dtype: 2^-24 for float32."""
    return torch.finfo(EXACT.get(dtype, dtype)).eps / 2


def reduction_terms(inputs: list, output: torch.Tensor) -> int:
    """How many input elements each element of `output` summarises, at most: the largest input's
    elements over the output's (a mean of 2^20 values: 2^20; an elementwise op or a GEMM whose
    operands are no larger than its output: 1)."""
    largest = max((x.numel() for x in inputs if isinstance(x, torch.Tensor)), default=1)
    return max(1, -(-largest // max(output.numel(), 1)))


def own_error(e: torch.Tensor, other: torch.Tensor | None, ratio: float = 1.0) -> tuple[float, float]:
    """(max |e - other|, ||e - other|| / ||other||) over the elements where both are finite, times
    `ratio`: how far the reference's own result is from the same computation in float64 (ratio
    1), or for a float64 output, how far the computation in float32 is, times 2^-29 (its
    conditioning in units of float64's roundoff); (0, 0) without one. Complex values compare as
    their real and imaginary parts."""
    if other is None or other.shape != e.shape:
        return 0.0, 0.0
    e, other = _real(e).double(), _real(other).double()
    finite = torch.isfinite(e) & torch.isfinite(other)
    if not bool(finite.any()):
        return 0.0, 0.0
    diff = torch.where(finite, e - other, 0.0)
    norm = float(torch.where(finite, other, 0.0).norm())
    return float(diff.abs().max()) * ratio, (float(diff.norm()) / norm * ratio if norm > 0 else 0.0)


def _rms_inverse(e: torch.Tensor) -> float:
    """sqrt(n) / ||e|| over the finite elements (0 for an all-zero output): atol times it is the
    whole-output relative error of an output off by atol everywhere."""
    e = _real(e).double()
    finite = e[torch.isfinite(e)]
    norm = float(finite.norm()) if finite.numel() else 0.0
    return finite.numel() ** 0.5 / norm if norm > 0 else 0.0


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def tolerances(outputs: list, errors: list | None, precision: str, atol: float | None = None,
               rtol: float | None = None, rel_l2: float | None = None) -> list[list[float]]:
    """[atol, rtol, rel_l2] for each reference output under `precision` (module docstring);
    `errors`: the reference's `own_error` per output ((worst, relative), (worst, relative, terms)
    or (worst, relative, terms, s): s the fraction of the serial worst case allowed, SERIAL unless
    given), or None where none was measured."""
    found = []
    for i, e in enumerate(outputs):
        if precision == "strict" and is_exact_float(e):
            found_error = errors[i] if errors is not None and i < len(errors) else (0.0, 0.0)
            worst, relative, terms, share = tuple(found_error) + (0.0, 0.0, 1, SERIAL)[len(found_error):]
            u = unit(e.dtype)
            floor, serial = u / unit(torch.float32), share * (terms - 1) * u
            rule = [min(max(FP32_TOLERANCE * floor, SCALE * worst), DICE_TOLERANCE),
                    min(max(FP32_TOLERANCE * floor, serial), DICE_TOLERANCE),
                    min(max(REL_L2 * floor, SCALE * relative, serial), DICE_TOLERANCE)]
            if u < unit(torch.float32):   # float64: an error of atol at every element is float64's own
                rule[2] = max(rule[2], min(rule[0] * _rms_inverse(e), DICE_TOLERANCE))
        else:
            rule = [DICE_TOLERANCE] * 3
        found.append([rule[0] if atol is None else atol, rule[1] if rtol is None else rtol,
                      rule[2] if rel_l2 is None else rel_l2])
    return found


def loosest(a: list | None, b: list) -> list:
    """Per output the larger of two `own_error` lists (timed calls take a task's loosest trial)."""
    if a is None or len(a) != len(b):
        return [tuple(t) for t in b]
    return [tuple(max(x, y) for x, y in zip(s, t)) for s, t in zip(a, b)]


def in_precision(inputs: list, dtype: torch.dtype) -> list:
    """`inputs` with every floating tensor in `dtype` (float64 or float32) and every complex one
    in the matching complex dtype."""
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    return [x.to(complex_dtype) if isinstance(x, torch.Tensor) and x.is_complex() else
            x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]


def model_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with its floating parameters and buffers in `dtype` and complex ones in the matching
    complex dtype (in place; `nn.Module.double()` leaves complex ones as they are)."""
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    return model._apply(lambda t: t.to(complex_dtype) if t.is_complex() else
                        t.to(dtype) if t.is_floating_point() else t)
