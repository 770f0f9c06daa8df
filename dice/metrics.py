"""KernelBench metrics over verification results (DESIGN.md §8).

All rates are fractions of *all* samples (a sample = one generated kernel for one task):

- compiled: the candidate built and loaded;
- correct: it matched the reference on every trial and broke no rule;
- fast_p: correct AND speedup > p (fast_0 needs a measured speedup, so verify with timing;
  without timing, `timed=False`, fast_p is None: unknown, not zero), at p = 0, 1, 2 and every
  threshold asked (`ps`; KernelBench's and DICE's analysis scripts report 0, 0.5, 0.8, 1, 1.5, 2);
- geomean_speedup: exp(mean(log speedup)) over the correct samples that were timed;
- pass@k: per task with n samples of which c are correct, the unbiased estimator of
  Chen et al. 2021, pass@k = 1 - C(n-c, k) / C(n, k), averaged over tasks with n >= k.

Results are `dice.verifier.VerifyResult`s or anything with `compiled`, `correct`, `speedup`.

Two evaluations of the same tasks (evaluate.py --out files) are compared per task, paired:

    python -m dice.metrics A.json B.json [--level N ...]

prints each evaluation's correct rate as the mean over the shared tasks of each task's rate (with
one sample per task, evaluate.py's correct %), on how many tasks each is better, and the exact
two-sided sign test over those tasks: p = min(1, 2 P[X <= min(n_A, n_B)]), X ~ Binomial(n_A + n_B,
1/2). On 43 tasks a difference of 2-3 tasks is well within chance; the test says how far within.

    python -m dice.metrics plot RUN [RUN ...] --out FILE.png

draws RL runs' curves (`dice.plot`). An RL step's line of their metrics.jsonl is `rl_step_record`.

    python -m dice.metrics learnable EVAL.json --tasks FILE.json --out LEARNABLE.json [--overwrite]

keeps the records of a DICE task file whose samples in an `evaluate.py --samples k` file (k >= 2,
temperature 1) disagree: a correct rate strictly between 0 and 1 (`learnable`). Their RL groups
have an advantage; a group whose samples all agree trains nothing (DESIGN.md §7). This is DAPO's
filter (arXiv 2503.14476 §3.2) applied once, before training, against the model that starts it;
`train.py --dynamic-sampling-rounds N` applies it during training instead.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .cli import ArgumentParser, at_least, fail_cleanly
from .errors import DataError, json_problem, read_text
from .inputs import input_path, output_file
from .tasks.load import load_tasks


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
    fast: dict[float, float | None] = field(default_factory=dict)   # fast_p at each threshold asked


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


def summarize_group(rows: list[tuple[str, object]], ks: Iterable[int] = (1, 5, 10), timed: bool = True,
                    ps: Iterable[float] = (0.0, 1.0, 2.0)) -> Summary:
    """Metrics for one group of (task name, result) rows; `timed`: whether the results were timed;
    ps: the fast_p thresholds of `Summary.fast`."""
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
        fast={p: fast_p(results, p) if timed else None for p in ps},
    )


def summarize(rows: Iterable[tuple[str, int | None, object]], ks: Iterable[int] = (1, 5, 10),
              timed: bool = True, ps: Iterable[float] = (0.0, 1.0, 2.0)) -> dict[str, Summary]:
    """Per-level metrics from (task name, level, result) rows.

    Keys are "level1", "level2", ... ("level?" for tasks without a level) and "all"."""
    rows = list(rows)
    ks, ps = tuple(ks), tuple(ps)
    groups = defaultdict(list)
    for name, level, result in rows:
        groups["level?" if level is None else f"level{level}"].append((name, result))
    summary = {key: summarize_group(groups[key], ks, timed, ps) for key in sorted(groups)}
    summary["all"] = summarize_group([(name, r) for name, _, r in rows], ks, timed, ps)
    return summary


def format_summary(summary: dict[str, Summary]) -> str:
    """A small fixed-width table of `summarize` output, one row per level."""
    ks = sorted({k for s in summary.values() for k in s.pass_at_k})
    ps = sorted({p for s in summary.values() for p in s.fast})
    header = ["group", "tasks", "samples", "compiled", "correct"] + [f"fast_{p:g}" for p in ps] + \
        ["geomean"] + [f"pass@{k}" for k in ks]
    lines = [header]
    for key, s in summary.items():
        lines.append([key, str(s.tasks), str(s.samples), _pct(s.compiled), _pct(s.correct)]
                     + [_pct(s.fast.get(p)) for p in ps]
                     + ["-" if s.geomean_speedup is None else f"{s.geomean_speedup:.2f}x"]
                     + [_pct(s.pass_at_k[k]) if k in s.pass_at_k else "-" for k in ks])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines)


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


# ---------------------------------------------------------------- two evaluations, paired

@dataclass
class Comparison:
    tasks: int              # tasks in both evaluations
    only_in_a: int          # tasks left out of the comparison
    only_in_b: int
    correct_a: float | None  # mean over the shared tasks of each task's correct rate (None: no task)
    correct_b: float | None
    a_better: int           # tasks whose correct rate is higher in A
    b_better: int
    p_value: float          # exact two-sided sign test over the a_better + b_better tasks


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided sign test: min(1, 2 P[X <= min(wins, losses)]), X ~ Binomial(wins + losses, 1/2)."""
    n = wins + losses
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def compare(a: dict, b: dict) -> Comparison:
    """Paired comparison of two evaluations' per-task correct outcomes ({task: [bool per sample]});
    tasks may have different sample counts, each task's rate counts once."""
    shared = sorted(a.keys() & b.keys(), key=str)
    rate_a = [statistics.fmean(a[t]) for t in shared]
    rate_b = [statistics.fmean(b[t]) for t in shared]
    a_better = sum(x > y for x, y in zip(rate_a, rate_b))
    b_better = sum(y > x for x, y in zip(rate_a, rate_b))
    return Comparison(len(shared), len(a.keys() - b.keys()), len(b.keys() - a.keys()),
                      statistics.fmean(rate_a) if shared else None, statistics.fmean(rate_b) if shared else None,
                      a_better, b_better, sign_test(a_better, b_better))


def read_outcomes(path: str | Path, levels: Iterable[int] = ()) -> dict[tuple[str, int | None], list[bool]]:
    """(task name, level) -> correct per sample, from an `evaluate.py --out` file (optionally only
    some levels)."""
    path, levels = Path(path), set(levels)
    not_ours = f"{path} is not an `evaluate.py --out` file (JSON with a 'results' list of task verdicts)"
    give = "give the file `evaluate.py --out` wrote"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path} does not exist; give the file `evaluate.py --out` wrote") from None
    except IsADirectoryError:
        raise DataError(f"{path} is a folder; {give}") from None
    except PermissionError:
        raise DataError(f"{path} is not readable (permission denied); fix its permissions, or {give}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{not_ours}: it is not valid JSON ({json_problem(e)}); {give}") from None
    except ValueError:   # not UTF-8 text
        raise DataError(f"{not_ours}: it is not UTF-8 text; {give}") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise DataError(f"{not_ours}; {give}")
    if data.get("verified") is False:
        raise DataError(f"{path} lists solutions that were not verified (evaluate.py generated them without a GPU); "
                        f"verify them with evaluate.py --solutions {data.get('solutions')} on a GPU machine first")
    outcomes: dict[tuple[str, int | None], list[bool]] = defaultdict(list)
    for i, r in enumerate(data["results"]):
        if not isinstance(r, dict) or not isinstance(r.get("task"), str) or type(r.get("correct")) is not bool \
                or not (r.get("level") is None or type(r.get("level")) is int):
            raise DataError(f"{path}: result {i} is not a verdict (a task name, a level or null, and correct true "
                            f"or false) but {json.dumps(r)[:80]}, so {path.name} is not an `evaluate.py --out` file "
                            "(or it was edited)")
        if not levels or r.get("level") in levels:
            outcomes[(r["task"], r.get("level"))].append(r["correct"])
    return dict(outcomes)


def learnable(outcomes: dict[tuple[str, int | None], list[bool]]) -> set[str]:
    """The names of the tasks whose samples disagree: some correct, some not."""
    return {name for (name, _), verdicts in outcomes.items() if 0 < sum(verdicts) < len(verdicts)}


def learnable_main(argv: list[str]) -> None:
    """`python -m dice.metrics learnable` (module docstring)."""
    p = ArgumentParser(prog="python -m dice.metrics learnable",
                       description="Keep the tasks of a DICE task file whose samples in an evaluate.py --samples k "
                                   "file disagree (the ones RL can learn from), as a new task file.")
    p.add_argument("evaluation", help="an evaluate.py --out file of --samples k >= 2 per task on --tasks")
    p.add_argument("--tasks", required=True, help="the DICE .json task file the evaluation ran on")
    p.add_argument("--out", required=True, help="the task file to write (DICE .json: the kept records as they are)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = p.parse_args(argv)
    tasks_file = input_path(args.tasks, "--tasks", "file", "give --tasks the DICE .json task file the evaluation ran on")
    if tasks_file.suffix != ".json":
        p.error(f"argument --tasks: {tasks_file} is not a DICE .json task file; give the one the evaluation ran on")
    if Path(args.out).suffix != ".json":
        p.error(f"argument --out: {args.out} does not end in .json, which train.py --data reads as a DICE task "
                "file; name it FILE.json")
    out = output_file(args.out, "--out", overwrite=args.overwrite, inputs={"--tasks": args.tasks,
                                                                           "evaluation": args.evaluation})
    outcomes = read_outcomes(args.evaluation)
    names = [t.name for t in load_tasks(tasks_file)]
    evaluated = {name for name, _ in outcomes} & set(names)
    if not evaluated:
        raise DataError(f"{args.evaluation} and {tasks_file} share no task; give the task file the evaluation ran on")
    if max(map(len, outcomes.values())) < 2:
        raise DataError(f"{args.evaluation} holds one sample per task, so no task's samples can disagree; evaluate "
                        "with --samples 8 (temperature 1)")
    keep = learnable(outcomes)
    records = [r for r, name in zip(json.loads(read_text(tasks_file)), names) if name in keep]
    out.write_text(json.dumps(records, indent=1))
    print(f"wrote {out}: {len(records)} of the {len(evaluated)} evaluated tasks of {tasks_file} (samples disagree)"
          + (f"; {len(names) - len(evaluated)} had no verdict" if len(evaluated) < len(names) else ""))


# ---------------------------------------------------------------- an RL step's record (metrics.jsonl)

def rl_step_record(step: int, sampled, update: dict, rt, reward_kind: str, update_s: float, started: float) -> dict:
    """RL step `step`'s line of metrics.jsonl (`dice.rl.train_rl`; README lists the keys). The rates
    and means are over every rollout the step drew on all processes (`rt.all_sum`, the same order on
    every rank); `sampled` is its `dice.rl.rollout.StepSamples`, `update` what `policy_update` returned.
    fast_1_pct (correct and speedup > 1) only under `--reward speedup`, the one reward that times;
    kernels_verified_per_s None when nothing was verified; update_tokens the update's micro-batch
    budget (`dice.memory.UpdateTokens`); step_time_s since `started`."""
    results, timing = sampled.results, sampled.timing
    n = rt.all_sum(len(sampled.rewards))
    tokens = rt.all_sum(sum(len(c.tokens) for c in sampled.completions))
    verified = rt.all_sum(sum(r is not None for r in results))
    return {"step": step, "reward_mean": rt.all_sum(sum(sampled.rewards)) / n,
            "compiled_pct": 100 * rt.all_sum(sum(bool(r and r.compiled) for r in results)) / n,
            "correct_pct": 100 * rt.all_sum(sum(bool(r and r.correct) for r in results)) / n,
            "fast_1_pct": (100 * rt.all_sum(sum(bool(r and r.correct and (r.speedup or 0) > 1) for r in results)) / n)
            if reward_kind == "speedup" else None,
            "mean_response_len": tokens / n, "kl": update["kl"], "clip_fraction": update["clip_fraction"],
            "loss": update["loss"], "groups_kept_pct": 100 * update["responses_trained"] / n,
            "tasks_drawn": sampled.drawn, "tasks_dropped": sampled.dropped, "rollout_rounds": sampled.rounds,
            "rollout_tokens_per_s": tokens / max(timing["generate_s"], 1e-9),
            "kernels_verified_per_s": verified / timing["verify_s"] if timing["verify_s"] > 0 else None,
            "generate_s": timing["generate_s"], "verify_s": timing["verify_s"], "update_s": update_s,
            "compile_s": update["compile_s"], "update_tokens": update["update_tokens"],
            "step_time_s": time.perf_counter() - started}


def rl_progress_fields(record: dict, dynamic_sampling: bool) -> dict:
    """What an RL step's progress line shows of its record (with dynamic sampling, the draws too)."""
    shown = {"reward": record["reward_mean"], "correct%": record["correct_pct"], "kl": record["kl"],
             "len": round(record["mean_response_len"]), "tok/s": round(record["rollout_tokens_per_s"])}
    if dynamic_sampling:
        shown |= {"tasks drawn": record["tasks_drawn"], "dropped": record["tasks_dropped"]}
    return shown


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plot"]:   # `python -m dice.metrics plot RUN ...`: dice.plot's command
        from .plot import main as plot   # here, not at the top: dice.plot imports this module (read_outcomes)
        return plot(argv[1:])
    if argv[:1] == ["learnable"]:
        return learnable_main(argv[1:])
    p = ArgumentParser(prog="python -m dice.metrics",
                       description="Compare two evaluate.py --out files task by task (paired sign test); "
                                   "`python -m dice.metrics plot --help`: RL runs' curves; `python -m dice.metrics "
                                   "learnable --help`: the tasks whose samples disagree.")
    p.add_argument("a", help="the first evaluate.py --out file")
    p.add_argument("b", help="the second, on the same tasks")
    p.add_argument("--level", type=at_least(0), nargs="+", default=[], help="only these levels (default: all)")
    args = p.parse_args(argv)
    c = compare(read_outcomes(args.a, args.level), read_outcomes(args.b, args.level))
    if not c.tasks:
        raise DataError(f"{args.a} and {args.b} share no task" + (f" at level(s) {args.level}" if args.level else "")
                        + "; compare evaluations of the same task file")
    print(f"tasks in both: {c.tasks}" + (f" (left out: {c.only_in_a} only in A, {c.only_in_b} only in B)"
                                         if c.only_in_a or c.only_in_b else ""))
    print(f"correct (mean of per-task rates): A {_pct(c.correct_a)}, B {_pct(c.correct_b)}")
    print(f"per task: A better on {c.a_better}, B better on {c.b_better}, "
          f"equal on {c.tasks - c.a_better - c.b_better}")
    print(f"sign test (exact, two-sided): p = {c.p_value:.3g}")


if __name__ == "__main__":
    fail_cleanly(main)
