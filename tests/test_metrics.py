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


def test_sign_test_hand_computed():
    from dice.metrics import sign_test
    assert sign_test(0, 0) == 1.0
    assert sign_test(5, 0) == sign_test(0, 5) == pytest.approx(2 / 32)          # 2 * (1/2)^5
    assert sign_test(7, 2) == pytest.approx(2 * (1 + 9 + 36) / 512)              # 2 * P[Bin(9, 1/2) <= 2]
    assert sign_test(3, 3) == 1.0


def test_compare_pairs_tasks_and_averages_sampled_rates():
    from dice.metrics import compare
    a = {"t1": [True], "t2": [False, True], "t3": [True, True], "gone": [True]}
    b = {"t1": [False], "t2": [True, True], "t3": [True, True], "new": [False]}
    c = compare(a, b)
    assert (c.tasks, c.only_in_a, c.only_in_b) == (3, 1, 1)
    assert c.correct_a == pytest.approx((1 + 0.5 + 1) / 3) and c.correct_b == pytest.approx((0 + 1 + 1) / 3)
    assert (c.a_better, c.b_better, c.p_value) == (1, 1, 1.0)


def test_metrics_cli_compares_two_evaluate_files_and_errors_in_one_line(tmp_path, capsys):
    import json

    from dice.cli import fail_cleanly
    from dice.metrics import main

    def write(name, outcomes):
        records = [{"task": t, "level": level, "correct": ok} for t, level, ok in outcomes]
        (tmp_path / name).write_text(json.dumps({"summary": {}, "results": records}))
        return str(tmp_path / name)
    a = write("a.json", [(f"t{i}", 1 + i % 2, False) for i in range(6)])
    b = write("b.json", [(f"t{i}", 1 + i % 2, True) for i in range(6)])
    main([a, b])
    out = capsys.readouterr().out
    assert "correct (mean of per-task rates): A 0.0%, B 100.0%" in out
    assert "tasks in both: 6\n" in out and "A better on 0, B better on 6, equal on 0" in out
    assert "p = 0.0312" in out                                                  # 2 / 2^6
    main([a, b, "--level", "2"])
    assert "B better on 3" in capsys.readouterr().out
    # one name at two levels is two tasks
    same_name = write("d.json", [("t0", 1, True), ("t0", 2, True)])
    main([a, same_name])
    assert "tasks in both: 1 (left out: 5 only in A, 1 only in B)" in capsys.readouterr().out
    (tmp_path / "latin1.json").write_bytes(b"\xff\xfe{")
    (tmp_path / "no_task.json").write_text('{"results": [{"correct": true}]}')
    for argv, message in (([str(tmp_path / "none.json"), b], "none.json does not exist"),
                          ([str(tmp_path), b], "is a folder"),
                          ([str(tmp_path / "latin1.json"), b], "is not an `evaluate.py --out` file"),
                          ([str(tmp_path / "no_task.json"), b], "is not an `evaluate.py --out` file"),
                          ([a, write("c.json", [("x", 1, True)])], "share no task")):
        with pytest.raises(SystemExit) as stop:
            fail_cleanly(lambda: main(argv))
        assert message in str(stop.value.code) and "\n" not in str(stop.value.code)


def test_an_incorrect_kernel_with_a_speedup_counts_in_no_speed_metric():
    fast_but_wrong = VerifyResult("incorrect", compiled=True, speedup=8.0)
    results = [ok(2.0), fast_but_wrong]
    assert fast_p(results, 1.0) == pytest.approx(1 / 2)
    assert geometric_mean_speedup(results) == pytest.approx(2.0)


def learnable_case(tmp_path):
    """A DICE task file of four records and an evaluation of three of them, two samples or three each."""
    import json
    source = "import torch\n\n\nclass Model(torch.nn.Module):\n    pass\n\n\ndef get_inputs():\n    return []\n\n\n" \
             "def get_init_inputs():\n    return []\n"
    records = [{"id": name, "level": 1, "ops": [name], "pytorch_code": source} for name in "abcd"]
    (tmp_path / "rl.json").write_text(json.dumps(records))
    verdicts = [("a", True), ("a", True), ("b", True), ("b", False), ("c", False), ("c", False), ("c", True)]
    (tmp_path / "eval.json").write_text(json.dumps({"summary": {}, "results": [
        {"task": f"rl/{name}", "level": 1, "correct": ok} for name, ok in verdicts]}))
    return records, str(tmp_path / "rl.json"), str(tmp_path / "eval.json")


def test_learnable_keeps_the_records_whose_samples_disagree(tmp_path, capsys):
    """a: 2 of 2 correct (its group agrees), b: 1 of 2, c: 1 of 3, d: not evaluated: b and c are
    kept, as they were written (ops too), and load as tasks."""
    import json

    from dice.metrics import main
    from dice.tasks.load import load_tasks
    records, tasks, evaluation = learnable_case(tmp_path)
    out = tmp_path / "learnable.json"
    main(["learnable", evaluation, "--tasks", tasks, "--out", str(out)])
    assert json.loads(out.read_text()) == records[1:3]
    assert [t.name for t in load_tasks(out)] == ["learnable/b", "learnable/c"]
    assert capsys.readouterr().out == f"wrote {out}: 2 of the 3 evaluated tasks of {tasks} (samples disagree); " \
                                      "1 had no verdict\n"


def test_learnable_refuses_in_one_line_what_it_cannot_use(tmp_path, capsys):
    import json

    from dice.cli import fail_cleanly
    from dice.metrics import main
    _, tasks, evaluation = learnable_case(tmp_path)
    (tmp_path / "one.json").write_text(json.dumps({"results": [{"task": "rl/a", "level": 1, "correct": True}]}))
    (tmp_path / "other.json").write_text(json.dumps({"results": [{"task": "x/a", "level": 1, "correct": True}]}))
    (tmp_path / "taken.json").write_text("[]")
    out = str(tmp_path / "new.json")
    for argv, status, message in (
            ([str(tmp_path / "one.json"), "--tasks", tasks, "--out", out], 1,
             "holds one sample per task, so no task's samples can disagree; evaluate with --samples 8"),
            ([str(tmp_path / "other.json"), "--tasks", tasks, "--out", out], 1, "share no task"),
            ([evaluation, "--tasks", tasks, "--out", str(tmp_path / "taken.json")], 2, "already exists; pass --overwrite"),
            ([evaluation, "--tasks", tasks, "--out", str(tmp_path / "new.txt")], 2, "does not end in .json"),
            ([evaluation, "--tasks", str(tmp_path), "--out", out], 1, "--tasks")):
        with pytest.raises(SystemExit) as stop:
            fail_cleanly(lambda: main(["learnable", *argv]))
        if status == 2:
            err = capsys.readouterr().err
            assert stop.value.code == 2 and message in err and err.count("\n") == 1, err
        else:   # sys.exit(message): status 1
            assert message in stop.value.code and "\n" not in stop.value.code, stop.value.code
    assert not (tmp_path / "new.json").exists()
