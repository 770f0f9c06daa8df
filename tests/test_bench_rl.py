"""`python -m dice.bench rl` on the CPU: the replayed programs and their references' verdicts, the
token counts, and one step of a tiny model with the Python reward (issues 27, 36)."""
import ast
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import pytest

from dice.bench.replay import CHARS_PER_TOKEN, ReplayTokenizer, replay_programs, with_device_line
from dice.bench.verify import CUPY_CANDIDATE, INLINE_CANDIDATE, TASK
from dice.tasks.load import load_tasks

from conftest import run_bounded

TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"


@pytest.fixture
def solutions(tmp_path):
    """A DICE JSON file with a load_inline and a CuPy reference solution."""
    records = []
    for i, candidate in enumerate((INLINE_CANDIDATE, CUPY_CANDIDATE)):
        fields = {"tag": f"t{i}", "scale": f"{1.5 + i}", "shift": "0.25"}
        records.append({"id": i, "level": 1, "pytorch_code": TASK.format(**fields),
                        "cuda_code": candidate.format(**fields)})
    path = tmp_path / "solutions.json"
    path.write_text(json.dumps(records))
    return path


def test_replayed_programs_are_distinct_and_broken_in_the_stated_share(solutions):
    tasks = load_tasks(solutions)
    replay = replay_programs(tasks, group_size=10, broken=0.3, seed=0, run=0)
    kinds = [kind for _, kind in replay]
    assert len(replay) == 20 and kinds.count("compile_error") == kinds.count("incorrect") == 3
    programs = [t.solution for t, _ in replay]
    assert len(set(programs)) == 20 and all(ast.parse(p) for p in programs)
    for (owner, kind), source in zip(replay, [t.solution for t in tasks for _ in range(10)]):
        salt = next(line for line in owner.solution.splitlines() if "dice_bench_salt_" in line)
        lines = owner.solution.splitlines()
        assert "__global__" in lines[lines.index(salt) + 1 + (kind == "compile_error")]
        assert ("dice_bench_undeclared_" in owner.solution) == (kind == "compile_error")
        assert owner.solution.endswith("ModelNew.forward = _dice_bench_off_by_one\n") == (kind == "incorrect")
        assert owner.source == next(t.source for t in tasks if t.solution == source)
    again = replay_programs(tasks, group_size=10, broken=0.3, seed=0, run=1)
    assert [k for _, k in again] == kinds and not {t.solution for t, _ in again} & set(programs)


def test_device_line_goes_above_the_kernels_extern_c_or_template_line():
    program = 'code = r"""\n#include <x>\nextern "C"\n__global__ void k() {}\n"""\n'
    expected = 'code = r"""\n#include <x>\nLINE\nextern "C"\n__global__ void k() {}\n"""\n'
    assert with_device_line(program, "LINE") == expected
    template = "template <int N>\n__global__ void k() {}"
    assert with_device_line(template, "L") == "L\n" + template
    assert with_device_line("import torch\n", "L") is None


def test_estimated_token_counts_and_ids():
    tok = ReplayTokenizer(None, vocab_size=320, mask_id=319)
    text = "x" * 1000
    ids = tok.encode(text)
    assert len(ids) == math.ceil(1000 / CHARS_PER_TOKEN) and ids == tok.encode(text) and ids != tok.encode("y" * 1000)
    assert 319 not in ids and max(ids) < 320 and tok.eos_token_ids == () and tok.decode(ids) == ""


@pytest.mark.slow
def test_one_step_on_a_tiny_model_with_the_python_reward(solutions, capsys):
    """The baseline and the optimised step (--compare) of 2 tasks x 2 samples on the CPU."""
    from dice.bench import main
    main(["rl", "--shape", str(TINY), "--solutions", str(solutions), "--tasks-per-step", "2", "--group-size", "2",
          "--max-new-tokens", "8", "--reward", "python", "--broken", "0.5", "--compare"])
    out, err = capsys.readouterr()
    # the log keeps the moment each step's last rollout was generated, not only the 5 s ticks
    assert all(any(f"] {run}: rollouts generated 4/4, verified" in line for line in err.splitlines())
               for run in ("baseline", "step"))
    assert "2 tasks x 2 = 4 rollouts" in out and "an estimate of 3.8 chars a token" in out
    lines = out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.strip().startswith("run"))):][:3]
    assert "stream overlap, batch 4, fp32 rollouts, dense update, round rows" in table[1]
    assert "stream overlap, batch 4, fp32 rollouts, dense update, response rows" in table[2]
    assert all("update (" in row or "generate (" in row for row in table[1:])
    assert out.count("4 rollouts, 32 tokens") == 2 and "reward mean 0.50" in out
    assert "references not checked (python reward)" in out


@pytest.mark.slow
def test_bench_rl_times_the_function_train_rl_runs(solutions, tmp_path, monkeypatch, capsys):
    """Both `train_rl` and `bench rl` reach the rollouts and the update through one function,
    `dice.rl.train_rl.rl_step` (issue 66: the bench built the step again from its parts)."""
    import dice.rl.train_rl as train_module
    from dice.bench import main
    from dice.config import TrainConfig
    from test_rl import TASKS, rl_model_folder

    callers = []
    for name in ("sample_step", "policy_update"):
        def spy(*args, real=getattr(train_module, name), name=name, **kwargs):
            callers.append((name, sys._getframe(1).f_code.co_name))
            return real(*args, **kwargs)
        monkeypatch.setattr(train_module, name, spy)
    main(["rl", "--shape", str(TINY), "--solutions", str(solutions), "--tasks-per-step", "2", "--group-size", "2",
          "--max-new-tokens", "8", "--reward", "python", "--broken", "0.5"])
    assert "4 rollouts, 32 tokens" in capsys.readouterr().out
    cfg = TrainConfig(phase="e2e", model=str(rl_model_folder(tmp_path / "model")), out=str(tmp_path / "run"),
                      steps=1, tasks_per_step=2, group_size=2, max_new_tokens=8, rollout_batch=4)
    train_module.train_rl(cfg, reward_fn=lambda tasks, completions: [float(len(c.tokens) % 2) for c in completions],
                          tasks=TASKS)
    assert callers == [("sample_step", "rl_step"), ("policy_update", "rl_step")] * 2


def test_verifier_reward_without_a_gpu_is_one_line(solutions, capsys):
    from dice.bench import main
    with pytest.raises(SystemExit, match="--reward verifier needs a CUDA GPU; pass --reward python"):
        main(["rl", "--shape", str(TINY), "--solutions", str(solutions)])


class VerdictVerifier:
    """What `correct_references` needs of a Verifier: a cache folder and map, whose verdict is the
    reference's first line (a comment) and which records the programs it was given."""

    def __init__(self, cache_dir):
        self.cache_dir, self.seen = cache_dir, []

    def prepare(self, task_srcs, **options):
        return []

    def map(self, pairs, progress=None, on_broken_task=None, **options):
        from types import SimpleNamespace
        results = []
        for i, (task, program) in enumerate(pairs):
            self.seen.append(program)
            status = program.splitlines()[0].lstrip("# ")
            if status == "task_error":
                on_broken_task(i, ValueError("the reference failed"))
                results.append(None)
            else:
                results.append(SimpleNamespace(status=status))
            progress(i, results[-1])
        return results


def test_only_references_the_verifier_calls_correct_are_replayed_each_checked_once(tmp_path):
    from dice.bench.common import BenchRun
    from dice.bench.replay import correct_references
    from dice.tasks.load import Task
    verdicts = ["correct", "incorrect", "correct", "task_error", "compile_error", "correct", "correct"]
    tasks = [Task(f"t{i}", 1 + i // 4, f"class Model: pass  # {i}", solution=f"# {v}\nclass ModelNew: pass  # {i}")
             for i, v in enumerate(verdicts)]
    (tmp_path / "one").mkdir()
    one = VerdictVerifier(tmp_path / "one")     # rounds ask a quarter more than still needed, rounded up
    assert [t.name for t in correct_references(tasks, 1, one, BenchRun("rl"), timeout_s=1.0)[0]] == ["t0"]
    assert one.seen == [tasks[0].solution, tasks[1].solution]
    verifier = VerdictVerifier(tmp_path)
    chosen, seen = correct_references(tasks, 3, verifier, BenchRun("rl"), timeout_s=1.0)
    # curriculum order; 3 + 1 checked first, of which t1 and t3 fail, so t4 (compile_error) and t5 next
    assert [t.name for t in chosen] == ["t0", "t2", "t5"]
    assert dict(seen) == {"correct": 3, "incorrect": 1, "task_error": 1, "compile_error": 1}
    assert len(verifier.seen) == 6
    again = VerdictVerifier(tmp_path)     # a later run: every verdict from the cache, one new reference
    chosen, _ = correct_references(tasks, 4, again, BenchRun("rl"), timeout_s=1.0)
    assert [t.name for t in chosen] == ["t0", "t2", "t5", "t6"] and again.seen == [tasks[6].solution]
    changed = [dataclasses.replace(tasks[0], solution="# incorrect\nclass ModelNew: pass")]
    assert correct_references(changed, 1, VerdictVerifier(tmp_path), BenchRun("rl"), timeout_s=1.0)[0] == []


def test_the_tokenizer_that_counts(tmp_path, monkeypatch):
    from dice.bench.replay import tokenizer_folder
    monkeypatch.chdir(tmp_path)
    assert tokenizer_folder("1.7b", None) is None and tokenizer_folder("1.7b", "given") == "given"
    (tmp_path / "shared" / "sdar-chat").mkdir(parents=True)
    (tmp_path / "shared" / "sdar-chat" / "tokenizer.json").write_text("{}")
    assert tokenizer_folder("8B", None) == "shared/sdar-chat"
    assert tokenizer_folder(str(TINY), None) is None          # a model folder without a tokenizer: the estimate


@pytest.mark.gpu
@pytest.mark.slow
def test_one_step_with_the_verifier_on_the_gpu(tmp_path, capsys, monkeypatch):
    """1 task x 2 samples of a CuPy reference (NVRTC builds, no load_inline build), one broken: the
    reference is verified once and its verdict kept, the step's verdicts are the replayed ones."""
    from dice.bench import main
    monkeypatch.setenv("DICE_CACHE_DIR", str(tmp_path / "cache"))
    fields = {"tag": "t1", "scale": "2.5", "shift": "0.25"}
    path = tmp_path / "cupy.json"
    path.write_text(json.dumps([{"id": 1, "level": 1, "pytorch_code": TASK.format(**fields),
                                 "cuda_code": CUPY_CANDIDATE.format(**fields)}]))
    main(["rl", "--shape", str(TINY), "--solutions", str(path), "--tasks-per-step", "1", "--group-size", "2",
          "--max-new-tokens", "8", "--workers", "2", "--broken", "0.5", "--attention", "dense"])
    out = capsys.readouterr().out
    assert "references checked: correct 1" in out and "verdicts compile_error=1 correct=1" in out
    assert f"kept in {tmp_path / 'cache' / 'bench-rl-references.json'} (delete it" in out
    assert list(json.loads((tmp_path / "cache" / "bench-rl-references.json").read_text()).values()) == ["correct"]


SUMMARY = re.compile(r"(\d+) rollouts, (\d+) tokens; verdicts \(python reward\); reward mean ([\d.]+); update: "
                     r"(\d+) rounds of (\d+) kept responses, loss (\S+), grad norm (\S+), ")


@pytest.mark.slow
def test_two_processes_share_the_step_and_update_as_one(solutions, capsys):
    """`torchrun --nproc_per_node 2 -m dice.bench rl` over gloo: 3 tasks x 2 samples split by task slot
    as train.py splits them (rank 0 slots 0 and 2: 4 rollouts, rank 1 slot 1), every response cut at
    --max-new-tokens 8 (the programs are far longer); rank 0 alone prints, each process's seconds in
    the row; the update over both processes equals one process's (rollouts are seeded by slot)."""
    from dice.bench import main
    args = ["rl", "--shape", str(TINY), "--solutions", str(solutions), "--tasks-per-step", "3", "--group-size", "2",
            "--max-new-tokens", "8", "--reward", "python", "--broken", "0.5"]
    main(args)
    one = SUMMARY.search(capsys.readouterr().out).groups()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    res = run_bounded([*torchrun, "-m", "dice.bench", *args], timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("rl bench:") == 1 and "2 processes (FSDP2)" in res.stdout
    header, values = (re.split(r"\s{2,}", line.strip()) for line in res.stdout.strip().splitlines()[-2:])
    row = dict(zip(header, values))
    assert row["run"] == "stream overlap, batch 4, fp32 rollouts, dense update, response rows, 2 processes"
    for stage in ("generate s", "verify s", "update s"):   # the step's time is the slowest process's
        by_rank = [float(v) for v in row[f"{stage} by rank"].split()]
        assert len(by_rank) == 2 and max(by_rank) == float(row[stage])
    two = SUMMARY.search(res.stdout).groups()
    assert two[:2] == one[:2] == ("6", "48")
    assert two[2:5] == one[2:5]                              # reward mean, rounds, kept responses
    assert float(two[5]) == pytest.approx(float(one[5]), abs=1e-6)
    assert float(two[6]) == pytest.approx(float(one[6]), rel=1e-4) and float(one[6]) > 0


def test_the_pool_load_is_the_busy_seconds_over_the_interval(monkeypatch):
    """Between two samples 10 s apart the 14 workers answered for 70 s in all and the 3 judges for
    25 s: on average 7.0 and 2.5 busy; the text holds until the next interval has passed."""
    from types import SimpleNamespace

    import dice.bench.rl_step as rl_step

    class Pool:
        samples = iter([(14, 100.0, 3, 10.0, 0), (14, 150.0, 3, 20.0, 5), (14, 170.0, 3, 35.0, 9)])

        def activity(self):
            return next(self.samples)

        def worker_starts(self):
            return "worker starts: 3 forked (median 1.2 s)"

        stats = SimpleNamespace(stage_times=lambda: "median on the worker 0.50 s")

    clock = iter([0.0, 4.0, 10.0])
    monkeypatch.setattr(rl_step.time, "perf_counter", lambda: next(clock))
    load = rl_step.PoolLoad(Pool(), every_s=5.0)
    assert load() == ""                                   # 4 s: too soon
    assert load() == ("; busy: workers 7.0/14, judges 2.5/3; prebuilds pending 9; "
                      "worker starts: 3 forked (median 1.2 s); median on the worker 0.50 s")


def test_the_replayed_reward_gives_the_verifiers_memory_to_the_batch_sizing():
    """`bench rl`'s reward (the verifier's, each completion's code replaced by its owner's program)
    keeps the reward's `prepare` and `gpu_bytes`: without gpu_bytes the 8B's rollout batch on the
    H100 of 2026-12-06 was sized as if the verifier's 17 processes held nothing (31 sequences, out
    of memory)."""
    from types import SimpleNamespace
    from dice.bench.replay import make_reward
    from dice.sampling.completion import Completion

    calls = []
    verifier = SimpleNamespace(gpu_bytes=lambda: 17 * 2**30,
                               prepare=lambda srcs, **kw: calls.append(("prepare", list(srcs))),
                               map=lambda pairs, **kw: calls.append(("map", list(pairs))) or [None] * len(pairs))
    reward = make_reward("verifier", verifier, {}, timeout_s=5.0)
    assert reward.gpu_bytes() == 17 * 2**30
    task = SimpleNamespace(source="SRC", solution="PROGRAM")
    reward.prepare([task])
    scores = reward([task], [Completion(prompt_ids=[0], tokens=[1], step_map=[1], text="x", code="generated")])
    assert calls == [("prepare", ["SRC"]), ("map", [("SRC", "PROGRAM")])] and scores.rewards == [0.0]
