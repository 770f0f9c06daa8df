"""The speedup: the candidate and the eager baseline timed call by call, alternating, until the
estimate is stable (DESIGN.md §8.3).

Both are timed the same way (`timing.CallRunner`: a CUDA-graph replay when both capture faithfully,
else an eager call; `sealed.SealedCalls`: by the trainer's clock, the candidate's worker stopped
but for its own calls) on the same inputs, call for call, while the GPU lock is held exclusively, so no other candidate's work runs meanwhile and nothing is cached between
candidates (a baseline measured under some earlier candidate's contention cannot be inherited).
Round r times calls k..k+n-1, each on the baseline and then on the candidate, and gives
ratio_r = median(baseline's times) / median(candidate's times); slow drift of the GPU's clocks or
a noisy neighbour affects both halves of a round alike. Rounds continue until the 95% confidence
interval of the geometric mean of the ratios is within +-CI_TARGET (Student's t on the log
ratios, at least MIN_ROUNDS rounds, as GPU MODE's harness repeats until the relative error is
small) or BUDGET_S of timing have passed; the speedup is that geometric mean, reported with its
interval. A speedup above PLAUSIBLE is measured again by a fresh worker process (the verifier
reports the lower of the two).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

MIN_ROUNDS = 3
MAX_ROUNDS = 40
CI_TARGET = 0.02
BUDGET_S = 6.0
PLAUSIBLE = 10.0            # KernelBench flags speedups above 10x

# two-sided 95% quantiles of Student's t with n - 1 degrees of freedom, n rounds
_T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262,
        12: 2.201, 15: 2.145, 20: 2.093, 30: 2.045, 40: 2.023}


def t95(n: int) -> float:
    """Student's t quantile for n rounds (the next tabulated n below, which is conservative)."""
    return _T95[max(k for k in _T95 if k <= n)] if n >= 2 else math.inf


def estimate(ratios: list[float]) -> tuple[float, float, float]:
    """(geometric mean, lower, upper 95% bound) of per-round ratios."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = t95(len(logs)) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def stable(ratios: list[float]) -> bool:
    if len(ratios) < MIN_ROUNDS:
        return False
    center, low, high = estimate(ratios)
    return high / center - 1 <= CI_TARGET and 1 - low / center <= CI_TARGET


@dataclass
class Timing:
    speedup: float
    ci: tuple[float, float]
    runtime_ms: float          # median over the candidate's timed calls
    baseline_ms: float
    method: str                # "graph" or "eager"
    rounds: int


def calls_per_round(ms_per_call: float, target_ms: float = 8.0) -> int:
    """Calls per side in a round: about `target_ms` of the reference's calls, between 3 and 32."""
    return max(3, min(32, int(target_ms / max(ms_per_call, 1e-3))))


def paired_rounds(timed_round, calls: int, budget_s: float = BUDGET_S):
    """Rounds of `timed_round(first, calls)` (the baseline's and the candidate's times in ms of
    calls first .. first + calls - 1, or a verdict that ends the timing, passed through) until
    `stable` or out of budget."""
    ratios, base_all, cand_all = [], [], []
    deadline, first = time.monotonic() + budget_s, 0
    while len(ratios) < MAX_ROUNDS:
        result = timed_round(first, calls)
        if not isinstance(result, tuple):
            return result
        base, cand = result
        first += calls
        ratios.append(statistics.median(base) / statistics.median(cand))
        base_all += base
        cand_all += cand
        if stable(ratios) or (len(ratios) >= 2 and time.monotonic() > deadline):
            break
    center, low, high = estimate(ratios)
    return Timing(center, (low, high), statistics.median(cand_all), statistics.median(base_all), "", len(ratios))
