"""The precision rule: how close a candidate's outputs must be to the reference's (DESIGN.md §8.2).

`VerifyOptions.precision` picks one of
- "strict" (the default, the RL reward): a float32 or float64 task is computed in that precision.
  Judge and worker run torch with TF32 off (`math_flags`: cuBLAS and cuDNN would otherwise round
  fp32 operands to TF32, and a convolution kept in PyTorch would differ from a true fp32
  reference), and each fp32/fp64 output must pass allclose at atol = rtol = 1e-4 (KernelBench
  main's fp32 tolerance, ScalingIntelligence/KernelBench `src/kernelbench/eval.py`,
  `get_tolerance_for_precision`) and a whole-output relative error of REL_L2 = 1e-3, loosened
  where the reference's own fp32 rounding is larger: atol and rel_l2 are raised to SCALE times
  the reference's own error against the same Model run in float64 on the same inputs (a long
  cumsum near its zero crossings, a sum with cancellation), never above DICE's 1e-2. A TF32 or
  fp16 GEMM (errors ~4e-4 of the output's scale and more, hundreds of times a true fp32 GEMM's)
  fails the elementwise 1e-4; an fp32 kernel that sums in another order passes, and so does one
  that accumulates a million terms in one float with atomics (~4e-4 relative: as KernelBench
  main accepts it, and the H200 run of the honest MSE control showed, the whole-output bound
  is not tighter than 1e-3; its job is the garbage below atol, relative error ~1).
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


def math_flags(precision: str) -> None:
    """torch's TF32 switches for this precision: off under "strict"; torch's defaults under "dice"
    (cuBLAS without TF32, cuDNN with it)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = precision != "strict"


def is_exact_float(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float32, torch.float64)


def own_error(e: torch.Tensor, e64: torch.Tensor | None) -> tuple[float, float]:
    """(max |e - e64|, ||e - e64|| / ||e64||) over the elements where both are finite: how far the
    reference's own result is from the same computation in float64; (0, 0) without one."""
    if e64 is None or e64.shape != e.shape:
        return 0.0, 0.0
    e, e64 = e.double(), e64.double()
    finite = torch.isfinite(e) & torch.isfinite(e64)
    if not bool(finite.any()):
        return 0.0, 0.0
    diff = torch.where(finite, e - e64, 0.0)
    norm = float(torch.where(finite, e64, 0.0).norm())
    return float(diff.abs().max()), (float(diff.norm()) / norm if norm > 0 else 0.0)


def tolerances(outputs: list, errors: list | None, precision: str, atol: float | None = None,
               rtol: float | None = None, rel_l2: float | None = None) -> list[list[float]]:
    """[atol, rtol, rel_l2] for each reference output under `precision` (module docstring);
    `errors`: the reference's `own_error` per output, or None where no float64 run was made."""
    found = []
    for i, e in enumerate(outputs):
        if precision == "strict" and is_exact_float(e):
            worst, relative = errors[i] if errors is not None and i < len(errors) else (0.0, 0.0)
            rule = [min(max(FP32_TOLERANCE, SCALE * worst), DICE_TOLERANCE), FP32_TOLERANCE,
                    min(max(REL_L2, SCALE * relative), DICE_TOLERANCE)]
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


def in_float64(inputs: list) -> list:
    return [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
