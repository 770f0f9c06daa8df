"""Pictures of BiC-RL runs: `python -m dice.metrics plot`.

    python -m dice.metrics plot RUN [RUN ...] --out FILE.png [--chain] [--eval NAME STEP=FILE [STEP=FILE ...]]

draws, per RL step of each run folder's metrics.jsonl (what `dice.rl.train_rl` logs), the rollouts'
mean reward, their correct %, the share of responses in groups whose rewards differ (the only
ones that train: `groups_kept_pct`), the KL (k3) and the clip fraction of the update, and the
greedy evaluation's correct %: the run's own `--eval-every` points, and each `--eval` series of
`evaluate.py --out` files, one point per file at the step given (the mean over its tasks of each
task's correct rate, as `python -m dice.metrics A.json B.json` counts it). One line per run, one
shared step axis; `--chain` lays the runs one after another on it (phase 2 started from phase 1's
final model), so run k's step s is drawn at s plus the last steps of the runs before it.

matplotlib is an optional extra: `pip install -e '.[plot]'`. An RL run of `train.py` ends by drawing
its own curves into its folder (`plot_run`).
"""
from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path

from .cli import ArgumentParser
from .errors import DataError, UserError, json_problem, read_text
from .metrics import read_outcomes

# (metrics.jsonl key, panel title, factor): the panels of an RL step record, in drawing order
STEP_PANELS = (("reward_mean", "reward (rollout mean)", 1.0),
               ("correct_pct", "correct % (rollouts)", 1.0),
               ("groups_kept_pct", "groups kept % (rewards not all equal)", 1.0),
               ("kl", "KL (k3, update mean)", 1.0),
               ("clip_fraction", "clip fraction (update mean)", 1.0))
EVAL_KEY, EVAL_TITLE = "eval_correct", "greedy evaluation: correct %"
FIGURE_INCHES, DPI = (11.0, 8.5), 100     # a 1100 x 850 PNG


@dataclass
class Run:
    name: str
    steps: list[dict]   # RL step records (they hold reward_mean)
    evals: list[dict]   # evaluation records of --eval-every (they hold eval_correct)

    @property
    def last_step(self) -> int:
        return max(r["step"] for r in self.steps + self.evals)


def read_run(path: str | Path) -> Run:
    """A run folder's metrics.jsonl (or the file itself), each line checked: a JSON object with an
    integer `step` whose plotted values are numbers or null."""
    path = Path(path)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"{file} does not exist; give the --out folder of a `train.py --phase infill|e2e` run "
                        "(it holds metrics.jsonl)")
    steps, evals = [], []
    for number, line in enumerate(read_text(file).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{file} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{file} is not valid JSONL ({json_problem(e, number)}; cut off while written?); delete "
                            "that line and plot again") from None
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise DataError(f"{where} is not a metrics record (a JSON object with an integer 'step'); "
                            "give a metrics.jsonl that train.py wrote")
        for key in [k for k, _, _ in STEP_PANELS] + [EVAL_KEY]:
            value = record.get(key)
            if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
                raise DataError(f"{where}: {key} is {value!r}, not a number; give a metrics.jsonl that train.py wrote")
        if "reward_mean" in record:
            steps.append(record)
        elif EVAL_KEY in record:
            evals.append(record)
    if not steps and not evals:
        raise DataError(f"{file} holds no RL step (reward_mean) and no evaluation (eval_correct); give the "
                        "folder of a `train.py --phase infill|e2e` run (an SFT run has neither)")
    name = (path if path.is_dir() else path.parent).resolve().name
    return Run(name, sorted(steps, key=lambda r: r["step"]), sorted(evals, key=lambda r: r["step"]))


def eval_point(file: str | Path) -> float:
    """Correct % of an `evaluate.py --out` file: the mean over its tasks of each task's correct rate."""
    outcomes = read_outcomes(file)
    if not outcomes:
        raise DataError(f"{file} holds no verdict; give an `evaluate.py --out` file of at least one task")
    return 100 * sum(sum(v) / len(v) for v in outcomes.values()) / len(outcomes)


def parse_eval_series(given: list[list[str]]) -> list[tuple[str, list[tuple[int, str]]]]:
    """`--eval NAME STEP=FILE ...` values -> [(NAME, [(STEP, FILE), ...])]; a ValueError says what is wrong."""
    series = []
    for name, *points in given:
        if "=" in name or not points:
            raise ValueError(f"give a series name, then STEP=FILE points (e.g. --eval held-out 0=before.json "
                             f"6=after.json), got {' '.join([name, *points])}")
        parsed = []
        for point in points:
            step, _, file = point.partition("=")
            if not step.isdigit() or not file:
                raise ValueError(f"{point} is not STEP=FILE (a step number >= 0, '=', an evaluate.py --out file)")
            parsed.append((int(step), file))
        series.append((name, sorted(parsed)))
    return series


def _figure():
    try:   # matplotlib is optional (the [plot] extra)
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("python -m dice.metrics plot needs matplotlib, which is not installed; "
                        "run pip install -e '.[plot]'") from None
    return Figure(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")


def draw(runs: list[Run], evals: list[tuple[str, list[tuple[int, float]]]] = (), chain: bool = False):
    """The figure: one panel per STEP_PANELS key and one of the evaluations, a line per run (label:
    the run's name) and per `evals` series (label: its name; points (step, correct %))."""
    fig = _figure()
    axes = list(fig.subplots(3, 2, sharex=True).flat)
    offset = 0
    for run in runs:
        for ax, (key, _, factor) in zip(axes, STEP_PANELS):
            points = [(r["step"] + offset, factor * r[key]) for r in run.steps if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=run.name)
        points = [(r["step"] + offset, 100 * r[EVAL_KEY]) for r in run.evals if r.get(EVAL_KEY) is not None]
        if points:
            axes[-1].plot(*zip(*points), marker="o", label=f"{run.name} (--eval-data)")
        offset += run.last_step if chain else 0
    for name, points in evals:
        axes[-1].plot(*zip(*points), marker="s", linestyle="--", label=name)
    for ax, title in zip(axes, [t for _, t, _ in STEP_PANELS] + [EVAL_TITLE]):
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in axes[-2:]:
        ax.set_xlabel("RL step" + (" (runs one after another)" if chain else ""))
    return fig


def plot_run(out: Path) -> str:
    """`out`/plot.png from the run's metrics.jsonl (`draw`): the line that names it, or why there is
    none (matplotlib missing, no step logged)."""
    later = f"python -m dice.metrics plot {out} --out {out / 'plot.png'}"
    if importlib.util.find_spec("matplotlib") is None:
        return f"no plot: matplotlib is not installed; pip install -e '.[plot]', then {later}"
    try:
        draw([read_run(out)]).savefig(out / "plot.png")
    except UserError as e:   # no step logged
        return f"no plot: {e}"
    return f"wrote {out / 'plot.png'} (the run's curves)"


def main(argv=None) -> None:
    p = ArgumentParser(prog="python -m dice.metrics plot",
                       description="Draw BiC-RL runs' reward, rollout correct %, groups kept %, KL, clip fraction "
                                   "and greedy evaluations per step into one PNG.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="RL run folders (train.py --out), or their metrics.jsonl")
    p.add_argument("--out", required=True, help="the PNG file to write")
    p.add_argument("--chain", action="store_true",
                   help="draw the runs one after another on the step axis (each started from the one before)")
    p.add_argument("--eval", nargs="+", action="append", metavar=("NAME", "STEP=FILE"),
                   help="a series of evaluate.py --out files, each drawn at its step on the plot's step axis "
                        "(repeat --eval for another series, e.g. another split)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.suffix.lower() != ".png":
        p.error(f"argument --out: {out} does not end in .png; name the PNG file to write")
    if not out.resolve().parent.is_dir():
        p.error(f"argument --out: the folder of {out} does not exist; create it or choose another path")
    try:
        series = parse_eval_series(args.eval or [])
    except ValueError as e:
        p.error(f"argument --eval: {e}")
    runs = [read_run(path) for path in args.runs]
    evals = [(name, [(step, eval_point(file)) for step, file in points]) for name, points in series]
    draw(runs, evals, args.chain).savefig(out)
    print(f"wrote {out}")
