"""KernelBench metrics on hand-made results (dice/metrics.py); expected numbers worked by hand."""

import math

import pytest

from dice.metrics import fast_p, format_summary, geometric_mean_speedup, pass_at_k, summarize
from dice.verifier import VerifyResult


def ok(speedup=None):
    return VerifyResult("correct", compiled=True, speedup=speedup)


WRONG = VerifyResult("incorrect", compiled=True)
BROKEN = VerifyResult("compile_error")


def test_pass_at_k_matches_the_combinatorial_formula():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)   # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0                           # fewer than k wrong samples
    assert pass_at_k(200, 13, 10) == pytest.approx(1 - math.comb(187, 10) / math.comb(200, 10))
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_fast_p_and_geomean():
    results = [ok(2.0), ok(0.5), ok(4.0), ok(None), WRONG]
    assert fast_p(results, 0.0) == pytest.approx(3 / 5)
    assert fast_p(results, 1.0) == pytest.approx(2 / 5)
    assert fast_p(results, 2.0) == pytest.approx(1 / 5)   # strictly greater than p
    assert geometric_mean_speedup(results) == pytest.approx(4 ** (1 / 3))  # (2 * 0.5 * 4) ** (1/3)
    assert geometric_mean_speedup([WRONG]) is None
    assert fast_p([], 1.0) == 0.0


def test_summarize_per_level_and_pass_at_k():
    rows = [
        ("a", 1, ok(3.0)), ("a", 1, WRONG),        # task a: 1 of 2 correct
        ("b", 1, BROKEN), ("b", 1, BROKEN),        # task b: 0 of 2
        ("c", 2, ok(0.5)), ("c", 2, ok(1.5)),      # task c: 2 of 2
    ]
    summary = summarize(rows, ks=(1, 2, 3))
    level1, level2, everything = summary["level1"], summary["level2"], summary["all"]
    assert (level1.tasks, level1.samples) == (2, 4)
    assert level1.compiled == pytest.approx(2 / 4) and level1.correct == pytest.approx(1 / 4)
    assert (level1.fast_1, level1.fast_2) == (pytest.approx(1 / 4), pytest.approx(1 / 4))
    assert level1.geomean_speedup == pytest.approx(3.0)
    assert level1.pass_at_k == {1: pytest.approx((0.5 + 0.0) / 2), 2: pytest.approx((1.0 + 0.0) / 2)}
    assert level2.fast_1 == pytest.approx(1 / 2) and level2.geomean_speedup == pytest.approx(math.sqrt(0.75))
    assert everything.correct == pytest.approx(3 / 6) and everything.tasks == 3
    assert everything.pass_at_k[1] == pytest.approx((0.5 + 0 + 1) / 3)
    assert 3 not in everything.pass_at_k                   # no task has 3 samples
    table = format_summary(summary)
    assert "level1" in table and "pass@2" in table and "3.00x" in table


def test_tasks_without_level_are_grouped():
    summary = summarize([("x", None, ok(1.0))])
    assert set(summary) == {"level?", "all"}
