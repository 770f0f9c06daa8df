"""`python -m dice.metrics plot` (dice/plot.py): the PNG, the plotted values against the metrics
files written here by hand, and one-line errors for bad input."""

import importlib.util
import json
import struct
import sys

import pytest

from dice.cli import fail_cleanly
from dice.metrics import main
from dice.plot import draw, read_run

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="the plot extra: pip install -e '.[test,plot]' (CI installs it)")

INFILL = [{"step": 0, "eval_reward": 0.25, "eval_correct": 0.25},
          {"step": 1, "reward_mean": 0.5, "correct_pct": 50.0, "groups_kept_pct": 25.0, "kl": 0.0,
           "clip_fraction": 0.0, "fast_1_pct": None},
          {"step": 2, "reward_mean": 0.625, "correct_pct": 62.5, "groups_kept_pct": 37.5, "kl": 0.002,
           "clip_fraction": 0.1, "fast_1_pct": None},
          {"step": 2, "eval_reward": 0.5, "eval_correct": 0.5}]
E2E = [{"step": 1, "reward_mean": 0.75, "correct_pct": 75.0, "groups_kept_pct": 50.0, "kl": 0.001},   # no clip_fraction
       {"step": 2, "reward_mean": 0.875, "correct_pct": 87.5, "groups_kept_pct": 12.5, "kl": 0.004,
        "clip_fraction": 0.2}]


def write_run(folder, records):
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(folder)


def write_eval(path, verdicts):
    """An evaluate.py --out file: (task, level, correct) per sample."""
    path.write_text(json.dumps({"summary": {}, "results": [{"task": t, "level": lv, "correct": ok}
                                                           for t, lv, ok in verdicts]}))
    return str(path)


def lines_by_label(ax) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


@needs_matplotlib
@pytest.mark.slow
def test_plot_writes_a_png_and_draws_the_files_values(tmp_path, capsys):
    infill, e2e = write_run(tmp_path / "infill", INFILL), write_run(tmp_path / "e2e", E2E)
    # task a: 1 of 2 samples correct, task b: 1 of 1 -> (0.5 + 1) / 2 = 75%; task a alone 0 of 1 -> 0%
    before = write_eval(tmp_path / "before.json", [("a", 3, False), ("b", 3, False)])
    after = write_eval(tmp_path / "after.json", [("a", 3, True), ("a", 3, False), ("b", 3, True)])
    out = tmp_path / "curves.png"
    main(["plot", infill, e2e, "--chain", "--out", str(out), "--eval", "held-out", f"4={after}", f"0={before}"])
    assert f"wrote {out}" in capsys.readouterr().out
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (1100, 850)            # 11 x 8.5 inches at 100 dpi

    fig = draw([read_run(infill), read_run(e2e)], [("held-out", [(0, 0.0), (4, 75.0)])], chain=True)
    reward, correct, kept, kl, clip, evaluation = fig.axes
    # --chain: e2e's steps 1, 2 come after infill's last step (2)
    assert lines_by_label(reward) == {"infill": ([1, 2], [0.5, 0.625]), "e2e": ([3, 4], [0.75, 0.875])}
    assert lines_by_label(correct) == {"infill": ([1, 2], [50.0, 62.5]), "e2e": ([3, 4], [75.0, 87.5])}
    assert lines_by_label(kept) == {"infill": ([1, 2], [25.0, 37.5]), "e2e": ([3, 4], [50.0, 12.5])}
    assert lines_by_label(kl) == {"infill": ([1, 2], [0.0, 0.002]), "e2e": ([3, 4], [0.001, 0.004])}
    assert lines_by_label(clip) == {"infill": ([1, 2], [0.0, 0.1]), "e2e": ([4], [0.2])}
    assert lines_by_label(evaluation) == {"infill (--eval-data)": ([0, 2], [25.0, 50.0]),
                                          "held-out": ([0, 4], [0.0, 75.0])}
    unchained = draw([read_run(infill), read_run(e2e)])
    assert lines_by_label(unchained.axes[0])["e2e"] == ([1, 2], [0.75, 0.875])


def test_the_eval_point_is_the_mean_of_per_task_rates(tmp_path):
    from dice.plot import eval_point
    file = write_eval(tmp_path / "e.json", [("a", 1, True), ("a", 1, False), ("a", 1, False), ("a", 1, True),
                                            ("b", 2, False), ("c", 3, True)])
    assert eval_point(file) == pytest.approx(100 * (0.5 + 0 + 1) / 3)


def plot_error(argv, capsys) -> tuple[int, str]:
    """(exit status, the one line printed) of `python -m dice.metrics plot ARGV`, run as its __main__ runs it."""
    with pytest.raises(SystemExit) as stop:
        fail_cleanly(lambda: main(["plot", *argv]))
    code = stop.value.code
    err = (capsys.readouterr().err + (code if isinstance(code, str) else "")).strip()
    assert err and err.count("\n") == 0, err
    return (1 if isinstance(code, str) else code), err


@pytest.mark.parametrize("lines, message", [
    (None, "metrics.jsonl does not exist; give the --out folder of a `train.py --phase infill|e2e` run"),
    ([json.dumps(E2E[0]), '{"step": 2, "reward_m'], "metrics.jsonl is not valid JSONL (Unterminated string starting at line 2 column 13; cut off while written?)"),
    ([json.dumps({"step": 1, "loss": 2.5, "lr": 1e-5})], "holds no RL step (reward_mean) and no evaluation"),
    ([json.dumps({"reward_mean": 0.5})], "line 1 is not a metrics record (a JSON object with an integer 'step')"),
    ([json.dumps({"step": 1, "reward_mean": "0.5"})], "line 1: reward_mean is '0.5', not a number"),
])
def test_a_bad_run_folder_is_one_line_naming_the_file(tmp_path, capsys, lines, message):
    run = tmp_path / "run"
    run.mkdir()
    if lines is not None:
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    code, err = plot_error([str(run), "--out", str(tmp_path / "x.png")], capsys)
    assert code == 1 and message in err and str(run / "metrics.jsonl") in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("flags, message", [
    (["--out", "x.pdf"], "argument --out: x.pdf does not end in .png"),
    (["--out", "no/such/x.png"], "argument --out: the folder of no/such/x.png does not exist"),
    (["--out", "x.png", "--eval", "0=a.json"], "argument --eval: give a series name, then STEP=FILE points"),
    (["--out", "x.png", "--eval", "held-out"], "argument --eval: give a series name, then STEP=FILE points"),
    (["--out", "x.png", "--eval", "held-out", "a.json"], "argument --eval: a.json is not STEP=FILE"),
    (["--out", "x.png", "--eval", "held-out", "x=a.json"], "argument --eval: x=a.json is not STEP=FILE"),
])
def test_bad_flags_are_a_usage_error(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    run = write_run(tmp_path / "run", E2E)
    code, err = plot_error([run, *flags], capsys)
    assert code == 2 and message in err


def test_a_missing_eval_file_is_one_line(tmp_path, capsys):
    run = write_run(tmp_path / "run", E2E)
    code, err = plot_error([run, "--out", str(tmp_path / "x.png"), "--eval", "valid", f"0={tmp_path / 'no.json'}"],
                           capsys)
    assert code == 1 and "no.json does not exist; give the file `evaluate.py --out` wrote" in err


def test_without_matplotlib_it_says_which_extra_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)           # import matplotlib... raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    run = write_run(tmp_path / "run", E2E)
    code, err = plot_error([run, "--out", str(tmp_path / "x.png")], capsys)
    assert code == 1 and "needs matplotlib, which is not installed; run pip install -e '.[plot]'" in err


@needs_matplotlib
@pytest.mark.slow
def test_a_run_that_train_rl_wrote_is_plotted(tmp_path):
    """The metrics.jsonl of a real (CPU, Python-reward) RL run: every step's reward, correct %
    (0: no verifier), groups kept % and KL are drawn as the run logged them."""
    from dice.config import TrainConfig
    from dice.rl.train_rl import train_rl
    from test_rl import TASKS, rl_model_folder

    def length_reward(ts, completions):
        return [len(c.tokens) / 8 for c in completions]

    cfg = TrainConfig(phase="e2e", model=str(rl_model_folder(tmp_path / "model")), out=str(tmp_path / "run"),
                      steps=2, tasks_per_step=2, group_size=4, rollout_batch=8, max_new_tokens=8, lr=1e-3)
    train_rl(cfg, reward_fn=length_reward, tasks=TASKS)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    reward, correct, kept, kl, _, _ = draw([read_run(tmp_path / "run")]).axes
    for ax, key in ((reward, "reward_mean"), (correct, "correct_pct"), (kept, "groups_kept_pct"), (kl, "kl")):
        assert lines_by_label(ax) == {"run": ([1, 2], [r[key] for r in logged])}, key


def test_a_run_without_matplotlib_ends_saying_how_to_draw_it_later(tmp_path, monkeypatch):
    from dice.plot import plot_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run = tmp_path / "run"
    write_run(run, E2E)
    assert plot_run(run) == (f"no plot: matplotlib is not installed; pip install -e '.[plot]', then "
                             f"python -m dice.metrics plot {run} --out {run / 'plot.png'}")
    assert not (run / "plot.png").exists()


@needs_matplotlib
def test_a_run_folder_gets_its_plot_or_the_reason_there_is_none(tmp_path):
    from dice.plot import plot_run
    run = tmp_path / "run"
    write_run(run, E2E)
    assert plot_run(run) == f"wrote {run / 'plot.png'} (the run's curves)"
    assert (run / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (run / "metrics.jsonl").write_text("")
    assert plot_run(run).startswith(f"no plot: {run / 'metrics.jsonl'} holds no RL step")
