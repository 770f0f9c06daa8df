"""`dice.bench.common.BenchRun`, which every `python -m dice.bench ...` runs under: progress, the
budget (no new work past it, partial rows marked), results appended as they arrive, and an
`--out` that is never a user's other file."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dice.bench.common import BenchRun, BudgetSpent
from dice.errors import UsageError


def test_rows_are_appended_as_they_arrive_and_tabled_with_partial_ones_marked(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    run = BenchRun("demo", budget_s=None, out=str(out))
    run.row({"mode": "a", "kernels/min": "10.0"})
    assert [json.loads(line)["mode"] for line in out.read_text().splitlines()] == ["a"]   # before finish
    run.row({"mode": "b", "extra": 1}, partial=True)
    run.finish()
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["mode", "kernels/min", "extra", "partial"]
    assert lines[1].split() == ["a", "10.0"] and lines[2].split() == ["b", "1", "yes"]
    again = BenchRun("demo", out=str(out))      # a later run appends to the same log
    again.row({"mode": "c"})
    again.finish()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["bench"], r["mode"], r["partial"]) for r in rows] == [("demo", "a", False), ("demo", "b", True),
                                                                      ("demo", "c", False)]


def test_past_the_budget_no_new_work_starts_and_the_table_says_what_was_cut(capsys):
    run = BenchRun("demo", budget_s=1e-9)
    with pytest.raises(BudgetSpent):
        run.check("row 2")
    run.finish()
    out = capsys.readouterr().out
    assert "the budget of 1e-09 s was spent" in out and "not started: row 2" in out and run.cut == "row 2"


class FakeVerifier:
    """map() reports each pair's result through `progress` in order, as Verifier.map does."""

    def __init__(self):
        self.started = 0

    def map(self, pairs, progress=None, on_broken_task=None, **options):
        for i, _ in enumerate(pairs):
            self.started += 1
            if i == 1:
                on_broken_task(i, ValueError("broken task"))
            else:
                progress(i, f"result {i}")
        return []


def test_a_verifier_map_stops_starting_candidates_once_the_budget_is_spent(monkeypatch):
    clock = iter([0.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0, 5.0])   # the budget (2 s) passes after the first result
    monkeypatch.setattr("dice.bench.common.time.perf_counter", lambda: next(clock, 5.0))
    run, verifier = BenchRun("demo", budget_s=2.0), FakeVerifier()
    results, _, complete = run.verify_map(verifier, [("t", "c")] * 4, "cupy")
    assert results == ["result 0", None, None, None] and not complete and verifier.started == 1
    assert run.cut == "the rest of cupy"
    broken = []
    results, _, complete = BenchRun("demo").verify_map(FakeVerifier(), [("t", "c")] * 3, "all",
                                                       on_broken_task=lambda i, e: broken.append(i))
    assert results == ["result 0", None, "result 2"] and complete and broken == [1]   # a broken task counts as done


@pytest.mark.parametrize("content", ['[{"pytorch_code": "x"}]\n', "plain text\n", '{"name": "a user row"}\n'])
def test_out_is_never_a_users_other_file(tmp_path, content):
    out = tmp_path / "solutions.json"
    out.write_text(content)
    with pytest.raises(UsageError, match="is not a benchmark log"):
        BenchRun("demo", out=str(out))
    assert out.read_text() == content
    with pytest.raises(UsageError, match="is a folder"):
        BenchRun("demo", out=str(tmp_path))


@pytest.mark.slow
def test_a_bench_command_refuses_such_an_out_in_one_line(tmp_path, capsys):
    import subprocess
    import sys
    out = tmp_path / "mine.json"
    out.write_text('{"mine": 1}\n')
    solutions = tmp_path / "s.json"
    solutions.write_text("[]")
    done = subprocess.run([sys.executable, "-m", "dice.bench", "builds", "--solutions", str(solutions), "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--out" in done.stderr and out.read_text() == '{"mine": 1}\n'


def test_the_checks_test_summary_puts_wall_time_beside_test_time_and_names_the_slowest():
    """`bench check`'s summary of a made-up DICE_TEST_LOG: per test the phases' seconds add up and
    the worst phase decides (a failed teardown fails a passed call; an xfail is counted apart);
    the row has the wall time beside the tests' own time, then each file's time and the slowest
    tests, longest first, at most `top`."""
    from dice.bench.suite import suite_summary

    def line(test, when, outcome, seconds, slow=False):
        return {"test": f"tests/{test}", "when": when, "outcome": outcome, "seconds": seconds, "at": 0.0,
                "slow": slow, "failure": ""}
    reports = [line("test_a_gpu.py::test_build", "setup", "passed", 100.0, slow=True),
               line("test_a_gpu.py::test_build", "call", "passed", 30.5, slow=True),
               line("test_a_gpu.py::test_build", "teardown", "passed", 0.0, slow=True),
               line("test_a_gpu.py::test_quick", "setup", "passed", 0.5),
               line("test_a_gpu.py::test_quick", "call", "passed", 2.0),
               line("test_b_gpu.py::test_leaky", "call", "passed", 10.0),
               line("test_b_gpu.py::test_leaky", "teardown", "failed", 1.0),
               line("test_b_gpu.py::test_gap", "call", "xfailed", 4.0),
               line("test_b_gpu.py::test_off", "setup", "skipped", 0.0),
               line("test_b_gpu.py::test_off", "teardown", "passed", 0.0)]
    row, lines = suite_summary(reports, wall_s=175.2, top=3)
    assert row["result"] == "2 passed, 1 failed, 1 skipped, 1 xfailed" and row["seconds"] == "175"
    assert row["detail"] == ("wall 175 s, tests' own time 148 s (not slow 18 s), outside tests 27 s; "
                             "failed: test_leaky")
    assert lines[0] == "test suite: wall 175 s; tests' own time 148 s over 5 tests"
    assert lines[1] == "by file: test_a_gpu.py 133 s, test_b_gpu.py 15 s"
    assert lines[2] == "slowest 3 tests (setup + call + teardown):"
    assert [line.split()[:2] + line.split()[-2:] for line in lines[3:]] == [
        ["130.5", "s", "passed", "tests/test_a_gpu.py::test_build"],
        ["11.0", "s", "failed", "tests/test_b_gpu.py::test_leaky"],
        ["4.0", "s", "xfailed", "tests/test_b_gpu.py::test_gap"]]
    assert "slow" in lines[3] and "slow" not in lines[4]
    cut, _ = suite_summary(reports[:3], wall_s=420.0, stopped_at=420.0)
    assert cut["result"] == "1 passed, 0 failed, 0 skipped (stopped at 420 s)"
    nothing, said = suite_summary([], wall_s=12.0)
    assert nothing["result"].startswith("0 passed") and "no test" in said[0]


STALL = """
import time
from dice.bench.common import BenchRun
run = BenchRun("demo", stall_s=0.5)
for _ in range({calls}):
    run.progress("working")
    time.sleep({pause})
run.finish()
time.sleep(1.0)
"""


@pytest.mark.parametrize("calls, pause, dumped", [(1, 1.5, True), (10, 0.1, False)])
def test_progress_that_stands_still_dumps_every_threads_stack(calls, pause, dumped):
    """No progress for stall_s seconds: the stacks on stderr (where a hung run waits); progress
    that keeps moving, and a finished run, print none."""
    out = subprocess.run([sys.executable, "-c", STALL.format(calls=calls, pause=pause)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    assert ("most recent call first" in out.stderr) == dumped
    assert ("time.sleep" in out.stderr or "line 7" in out.stderr) == dumped


def test_bench_builds_says_what_the_solutions_file_lacks(tmp_path):
    """`bench builds` on a file without `cuda_code` spoke of load_inline; it names the key it reads,
    and a file of programs without a load_inline build is told why they are not built."""
    from types import SimpleNamespace

    from dice.bench.build_cost import bench_builds
    task = "import torch\nclass Model(torch.nn.Module):\n    pass\ndef get_inputs():\n    return []\n" \
           "def get_init_inputs():\n    return []\n"
    args = SimpleNamespace(solutions=str(tmp_path / "s.json"), limit=None, group=None, jobs=1, arch=(9, 0),
                           binding=["dispatch"])
    (tmp_path / "s.json").write_text(json.dumps([{"pytorch_code": task}]))
    with pytest.raises(SystemExit, match=r"s.json: no record has a cuda_code program \(the key that holds a task's "
                                         r"reference solution\); pass a DICE JSON file whose records hold one$"):
        bench_builds(args, BenchRun("builds"))
    (tmp_path / "s.json").write_text(json.dumps([{"pytorch_code": task, "cuda_code": "import torch\nclass ModelNew(torch.nn.Module):\n    pass\n"}]))
    with pytest.raises(SystemExit, match=r"s.json: none of its 1 cuda_code programs builds a CUDA extension with "
                                         r"torch's load_inline, the builds this command times"):
        bench_builds(args, BenchRun("builds"))


def test_bench_verifys_grouped_row_sends_each_task_as_an_rl_group_of_new_sources():
    """`grouped`: 35 kernels in groups of 16 are 3 tasks (16, 16, 3 kernels), every kernel a new
    source whose constants are its task's."""
    from dice.bench.verify import CUPY_CANDIDATE, grouped
    pairs = grouped(35, 16, "s")
    tasks = [task for task, _ in pairs]
    assert [tasks.count(t) for t in dict.fromkeys(tasks)] == [16, 16, 3]
    assert len({CUPY_CANDIDATE.format(**f) for _, f in pairs}) == 35
    for task, fields in pairs:
        assert f"x * {fields['scale']} + {fields['shift']}" in task


def _rules_args(tmp_path, **over):
    from types import SimpleNamespace
    fixture = Path(__file__).parent / "fixtures" / "verifier" / "dice_infilling_sample.json"
    return SimpleNamespace(**{"solutions": str(fixture), "tasks_per_step": 64, "group_size": 3, "broken": 0.5,
                              "workers": 2, "no_attacks": False, "seed": 0, **over})


def test_bench_rules_judges_the_references_the_tests_candidates_and_a_replayed_step():
    """The program sets of issue #68's table: every reference of the file, the GPU tests' attacks and
    honest controls by name, and the step as `bench rl` replays it (2 tasks x 3 copies here), last."""
    from dice.bench import reward_rules as rules
    import test_verifier_gpu
    import test_verifier_integrity_gpu
    sets = rules.program_sets(_rules_args(None))
    assert list(sets) == ["references", "attacks", "honest controls", "rollouts"]
    assert [label.rsplit("/", 1)[1] for label, _, _ in sets["references"]] == [str(r["id"]) for r in json.loads(
        (Path(__file__).parent / "fixtures" / "verifier" / "dice_infilling_sample.json").read_text())]
    attacks = {label for label, _, _ in sets["attacks"]}
    assert attacks == set(test_verifier_gpu.CHEATS) | set(test_verifier_integrity_gpu.ATTACKS)
    assert len(sets["honest controls"]) == len(test_verifier_integrity_gpu.HONEST)
    assert len(sets["rollouts"]) == 2 * 3 and sum("(ok)" in label for label, _, _ in sets["rollouts"]) == 3
    assert list(rules.program_sets(_rules_args(None, no_attacks=True))) == ["references", "rollouts"]


def test_bench_rules_counts_what_dices_reward_calls_correct_and_ours_does_not(monkeypatch, capsys):
    """A fake pool: DICE's rule calls everything correct but a compile error; ours also refuses
    every program of the first task. The table counts them: of the 2 references, 1 let through,
    and the replayed copies of that task that compile; reasons grouped, numbers left out."""
    from dice.bench import reward_rules as rules
    from dice.verifier.results import VerifyResult

    refused = json.loads((Path(__file__).parent / "fixtures" / "verifier" / "dice_infilling_sample.json")
                         .read_text())[0]["pytorch_code"]   # ours refuses every program for this task

    def verdict(task: str, program: str, rule: str) -> VerifyResult:
        if "dice_bench_undeclared" in program:
            return VerifyResult("compile_error", message="nvcc: error")
        if rule == "strict" and task.strip() == refused.strip():
            return VerifyResult("invalid", compiled=True, message="timed calls: 3 launches of torch's kernels (x)")
        return VerifyResult("correct", compiled=True, correct=True, message="correct on 1 trials")

    class Pool:
        def __init__(self, workers):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, pairs, progress=None, on_broken_task=None, **options):
            rule = "dice" if options.get("rules") == "dice" else "strict"
            results = [verdict(task, program, rule) for task, program in pairs]
            for i, r in enumerate(results):
                progress(i, r)
            return results

    monkeypatch.setattr(rules, "Verifier", Pool)
    args = _rules_args(None, no_attacks=True)
    sets = rules.program_sets(args)
    expected = {name: sum(verdict(t, p, "dice").correct and not verdict(t, p, "strict").correct
                          for _, t, p in programs) for name, programs in sets.items()}
    assert expected["references"] == 1 and expected["rollouts"] > 0
    bench = BenchRun("rules")
    rules.bench_rules(args, bench)
    rows = {row["programs"]: row for row, _ in bench.rows}
    for name, n in expected.items():
        assert rows[name]["dice correct, strict not"] == n
        assert rows[name]["by strict's reason"] == (f"{n} invalid: timed calls" if n else "-")
    assert rows["references"]["judged by both"] == 2 and rows["rollouts"]["judged by both"] == 6
    assert rules.reason(VerifyResult("incorrect", message="output 0: 12 of 4096 elements differ (max 3.5e-2)")) == \
        "incorrect: output N"


def test_bench_stability_logs_each_verifiers_speedups_as_they_come(monkeypatch, capsys):
    """A run killed before its table (rows come at the end) still has every finished Verifier's
    speedups in its log, one line each."""
    from types import SimpleNamespace

    from dice.bench import stability
    from dice.verifier.results import VerifyResult

    class Pool:
        made = 0

        def __init__(self, workers, cache_dir):
            Pool.made += 1

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, pairs, progress=None, on_broken_task=None, **options):
            results = [VerifyResult("correct", compiled=True, correct=True, speedup=1.0 + Pool.made / 10 + i / 100,
                                    runtime_ms=1.0, baseline_ms=1.1, speedup_ci=(1.0, 1.3), timing="graph")
                       for i in range(len(pairs))]
            results[-1] = VerifyResult("incorrect", compiled=True)
            for i, r in enumerate(results):
                progress(i, r)
            return results

    monkeypatch.setattr(stability, "Verifier", Pool)
    stability.bench_stability(SimpleNamespace(verifiers=2, workers=1), BenchRun("stability"))
    err = capsys.readouterr().err
    first = next(iter(stability.CASES))
    assert f"verifier 1/2 speedups: {first} 1.100x" in err and f"verifier 2/2 speedups: {first} 1.200x" in err
    assert f"{list(stability.CASES)[-1]} incorrect" in err


@pytest.mark.parametrize("units", ["own", "shared"])
def test_bench_builds_keeps_units_where_asked(tmp_path, monkeypatch, units):
    """`--units own` builds each program with its units in its own folder, as the verifier builds a
    candidate (nothing one compiled is used for another); `shared` in the cache's one store (None:
    `fast_build`'s default, the root)."""
    from types import SimpleNamespace

    import dice.bench.build_cost as build_cost
    seen = []

    def fast_build(arguments, name, build_dir, root, capability, slots, *, flags=None, binding=None, units=None):
        seen.append((Path(build_dir), units))
        return build_dir / "ext.so", {"binding": binding, "host_cpu_s": 1.0, "device_cpu_s": 1.0, "link_cpu_s": 0.1}

    monkeypatch.setattr(build_cost.fast, "fast_build", fast_build)
    monkeypatch.setattr(build_cost, "_warm", lambda *a: 0.0)
    program = ("import torch\nfrom torch.utils.cpp_extension import load_inline\n"
               "ext = load_inline(name='relu', cpp_sources='torch::Tensor f(torch::Tensor x);', "
               "cuda_sources='torch::Tensor f(torch::Tensor x) { return x; }', functions=['f'])\n"
               "class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return ext.f(x)\n")
    task = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n" \
           "def get_inputs():\n    return [torch.randn(4)]\ndef get_init_inputs():\n    return []\n"
    (tmp_path / "s.json").write_text(json.dumps([{"pytorch_code": task, "cuda_code": program}]))
    args = SimpleNamespace(solutions=str(tmp_path / "s.json"), limit=None, group=None, jobs=2, arch=(9, 0),
                           binding=["dispatch"], units=units)
    build_cost.bench_builds(args, BenchRun("builds"))
    assert len(seen) == 1
    folder, kept = seen[0]
    assert kept == (folder if units == "own" else None)
