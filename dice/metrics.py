"""KernelBench metrics over verification results (DESIGN.md §8).

All rates are fractions of *all* samples (a sample = one generated kernel for one task):

- compiled: the candidate built and loaded;
- correct: it matched the reference on every trial and broke no rule;
- fast_p: correct AND speedup > p (fast_0 needs a measured speedup, so verify with timing;
  without timing, `timed=False`, fast_p is None: unknown, not zero);
- geomean_speedup: exp(mean(log speedup)) over the correct samples that were timed;
- pass@k: per task with n samples of which c are correct, the unbiased estimator of
  Chen et al. 2021, pass@k = 1 - C(n-c, k) / C(n, k), averaged over tasks with n >= k.

Results are `dice.verifier.VerifyResult`s or anything with `compiled`, `correct`, `speedup`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class Summary:
    tasks: int
    samples: int
    compiled: float
    correct: float
    fast_0: float | None
    fast_1: float | None
    fast_2: float | None
    geomean_speedup: float | None
    pass_at_k: dict[int, float] = field(default_factory=dict)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k)/C(n, k) as a product, which stays exact-ish for large n.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def fast_p(results: list, p: float) -> float:
    """Fraction of results that are correct with a measured speedup above p."""
    if not results:
        return 0.0
    hits = sum(1 for r in results if r.correct and r.speedup is not None and r.speedup > p)
    return hits / len(results)


def geometric_mean_speedup(results: list) -> float | None:
    """Geometric mean of speedup over correct, timed results; None when there are none."""
    speedups = [r.speedup for r in results if r.correct and r.speedup is not None and r.speedup > 0]
    if not speedups:
        return None
    return math.exp(sum(math.log(s) for s in speedups) / len(speedups))


def summarize_group(rows: list[tuple[str, object]], ks: Iterable[int] = (1, 5, 10), timed: bool = True) -> Summary:
    """Metrics for one group of (task name, result) rows; `timed`: whether the results were timed."""
    results = [r for _, r in rows]
    n = len(results)
    per_task = defaultdict(list)
    for name, r in rows:
        per_task[name].append(bool(r.correct))
    passes = {}
    for k in ks:
        eligible = [v for v in per_task.values() if len(v) >= k]
        if eligible:
            passes[k] = sum(pass_at_k(len(v), sum(v), k) for v in eligible) / len(eligible)
    return Summary(
        tasks=len(per_task),
        samples=n,
        compiled=sum(bool(r.compiled) for r in results) / n if n else 0.0,
        correct=sum(bool(r.correct) for r in results) / n if n else 0.0,
        fast_0=fast_p(results, 0.0) if timed else None,
        fast_1=fast_p(results, 1.0) if timed else None,
        fast_2=fast_p(results, 2.0) if timed else None,
        geomean_speedup=geometric_mean_speedup(results),
        pass_at_k=passes,
    )


def summarize(rows: Iterable[tuple[str, int | None, object]], ks: Iterable[int] = (1, 5, 10),
              timed: bool = True) -> dict[str, Summary]:
    """Per-level metrics from (task name, level, result) rows.

    Keys are "level1", "level2", ... ("level?" for tasks without a level) and "all"."""
    rows = list(rows)
    ks = tuple(ks)
    groups = defaultdict(list)
    for name, level, result in rows:
        groups["level?" if level is None else f"level{level}"].append((name, result))
    summary = {key: summarize_group(groups[key], ks, timed) for key in sorted(groups)}
    summary["all"] = summarize_group([(name, r) for name, _, r in rows], ks, timed)
    return summary


def format_summary(summary: dict[str, Summary]) -> str:
    """A small fixed-width table of `summarize` output, one row per level."""
    ks = sorted({k for s in summary.values() for k in s.pass_at_k})
    header = ["group", "tasks", "samples", "compiled", "correct", "fast_0", "fast_1", "fast_2",
              "geomean"] + [f"pass@{k}" for k in ks]
    lines = [header]
    for key, s in summary.items():
        lines.append([key, str(s.tasks), str(s.samples), _pct(s.compiled), _pct(s.correct), _pct(s.fast_0),
                      _pct(s.fast_1), _pct(s.fast_2),
                      "-" if s.geomean_speedup is None else f"{s.geomean_speedup:.2f}x"]
                     + [_pct(s.pass_at_k[k]) if k in s.pass_at_k else "-" for k in ks])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines)


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"
