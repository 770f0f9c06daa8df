"""What verifying a candidate takes and gives: the options, the verdict, the checks that need no
execution, and the seeds of one candidate's trials (DESIGN.md §8)."""
from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass

from ..tasks.load import parse_python
from .precision import PRECISIONS
from .rules import fallback_problem, kernel_names
from .wire import STATUSES

RULES = ("strict", "kernelbench", "dice")   # "dice": DICE's RL check, no kernel rule (`dice.protocols.DICE_REWARD`)
# compiled code's ways to a library GEMM whose epilogue computes an activation (torch's own entry
# point is unfused in the worker, `epilogues.unfuse_activations`; these are named in the source)
NATIVE_EPILOGUE = re.compile(r"CUBLASLT_EPILOGUE_\w*(?:RELU|GELU)|GEMMAndBiasActivationEpilogue|\bgemm_and_bias\b")


@dataclass
class VerifyResult:
    status: str
    compiled: bool = False
    correct: bool = False
    speedup: float | None = None
    runtime_ms: float | None = None
    baseline_ms: float | None = None
    message: str = ""
    speedup_ci: tuple[float, float] | None = None    # 95% interval of the speedup
    timing: str | None = None                        # how both were timed: "graph" or "eager"

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"unknown verification status {self.status!r}; expected one of {STATUSES}")
        self.correct = self.status == "correct"


class TaskError(ValueError):
    """The task itself (not the candidate) is broken: its reference fails or returns non-tensors."""


@dataclass(frozen=True)
class VerifyOptions:
    trials: int = 5
    timing: bool = True
    seed: int | None = None
    timeout_s: float = 120.0           # candidate run time: all trials + timing
    compile_timeout_s: float = 600.0   # module import, including a load_inline build
    rules: str = "strict"              # the kernel rule: "strict" (the RL reward), "kernelbench", or "dice" (none)
    precision: str = "strict"          # the precision rule (`precision`): "strict" (fp32 at 1e-4, TF32 off) or "dice"
    atol: float | None = None          # these three replace the precision rule's values for every output
    rtol: float | None = None
    rel_l2: float | None = None        # ||got - expected|| / ||expected|| of a whole output

    def __post_init__(self):
        if self.trials < 1:
            raise ValueError(f"trials={self.trials}: verification needs at least one correctness trial")
        if self.rules not in RULES:
            raise ValueError(f"rules={self.rules!r}: use one of {', '.join(RULES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: use one of {', '.join(PRECISIONS)}")

    def tolerance(self) -> dict:
        """What the judge needs to compare outputs (`precision.tolerances`)."""
        return {"precision": self.precision, "atol": self.atol, "rtol": self.rtol, "rel_l2": self.rel_l2}


# ---------------------------------------------------------------------------------------------
# Static checks on the candidate source.

def static_check(source: str, need_kernel: bool, rules: str = "strict") -> VerifyResult | None:
    """The verdict when `source` fails a check that needs no execution, else None. Under rules
    "dice" (DICE's own check) only that it parses and defines ModelNew."""
    try:
        tree = parse_python(source)
    except SyntaxError as exc:
        return VerifyResult("compile_error", message=f"candidate.py line {exc.lineno}: SyntaxError: {exc.msg}")
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes; nesting too deep for the parser
        return VerifyResult("compile_error", message=f"candidate.py does not parse: {type(exc).__name__}: "
                            f"{str(exc)[:200]}")
    defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    if "ModelNew" not in defined:
        return VerifyResult("invalid", message="the candidate defines no ModelNew; name the optimized "
                            "nn.Module class ModelNew")
    if rules == "dice":
        return None
    if need_kernel and not kernel_names(source):
        return VerifyResult("invalid", message="the candidate contains no __global__ CUDA kernel; ModelNew "
                            "must compute with its own kernels, not PyTorch ops or library calls")
    problem = fallback_problem(tree)
    if problem:
        return VerifyResult("invalid", message=problem)
    named = NATIVE_EPILOGUE.search(source) if rules == "strict" else None
    if named:
        return VerifyResult("invalid", message=f"the candidate names a cuBLASLt activation epilogue ({named.group()}); "
                            "ModelNew must compute the task's activation in its own kernels, not in a library GEMM's")
    return None


def trial_seeds(base: int, trials: int) -> tuple[int, list[int], int, int]:
    """(weight-init seed, one seed per trial, timing seed, warm-up seed), all from `base` and all
    distinct: timed calls and the load's warm-up forward use inputs no correctness trial uses."""
    rng = random.Random(base)
    init_seed, seeds = rng.randrange(2**31), [rng.randrange(2**31) for _ in range(trials)]
    timing_seed, warmup_seed = (rng.randrange(1, 2**31) for _ in range(2))
    while len({*seeds, timing_seed, warmup_seed}) < trials + 2:
        timing_seed, warmup_seed = (rng.randrange(1, 2**31) for _ in range(2))
    return init_seed, seeds, timing_seed, warmup_seed
