"""The shipped commands on a CPU-only machine: README's commands and the one-line errors."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "dice" / "assets" / "examples").glob("*.py"))


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_readme_sample_command_generates_a_kernel_without_downloads(tmp_path):
    out = tmp_path / "kernel.py"
    res = run("sample.py", "--prompt", str(EXAMPLES[0]), "--verify", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "class ModelNew" in res.stdout and "__global__" in res.stdout
    assert out.read_text().strip() == res.stdout.strip()
    assert "generating:" in res.stderr and "tokens/s" in res.stderr
    assert re.search(r"generating: \d+/1024 tokens at most \| \d+ tokens/s \| ETA at most \d+m\d\ds", res.stderr)
    assert "\r" not in res.stderr            # a log (no TTY) gets whole lines, not one redrawn line
    assert "verification needs a CUDA GPU" in res.stdout + res.stderr


@pytest.mark.slow
def test_embedded_model_writes_the_generators_solution_for_the_held_out_example(tmp_path, monkeypatch):
    """README's sample command on the CPU: greedy `dice-tiny` writes, for the held-out level-3 example,
    exactly the CuPy solution the curriculum generator made for that task (found by its PyTorch
    source in the seed-0 split), so prompt builder, tokenizer, sampler, model and code extraction
    still work together as when the model was measured. (The model is robust to small prompt
    edits: changed separators or wording leave its output as is; dropping the instruction does not.)"""
    from dice import taskgen
    example = ROOT / "dice" / "assets" / "examples" / "level3_sigmoid_abs_square_log_softmax.py"
    # drawn without the constant-output filter (~0.1 s a task), which draws nothing from the
    # generator: the split's records, and a few more
    monkeypatch.setattr(taskgen, "passed_by_a_constant", lambda task: False)
    heldout = taskgen.generate_split(4000, 90, 60, seed=0)[2]
    reference = [t["cuda_code"] for t in heldout if t["pytorch_code"] == example.read_text()]
    assert len(reference) == 1
    out = tmp_path / "kernel.py"
    res = run("sample.py", "--prompt", str(example), "--device", "cpu", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert out.read_text().strip() == reference[0].strip()


def test_every_shipped_example_is_a_valid_task():
    from dice.tasks.load import load_tasks
    assert len(EXAMPLES) == 3
    for p in EXAMPLES:
        assert load_tasks(p)[0].source == p.read_text()


def test_bad_task_and_missing_model_are_one_line_errors(tmp_path, refusal):
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    res = refusal("sample.py", "--prompt", str(bad))
    assert res.returncode != 0 and res.stderr.strip().count("\n") == 0
    assert "defines no Model, get_inputs, get_init_inputs" in res.stderr
    res = refusal("sample.py", "--prompt", str(EXAMPLES[0]), "--model", str(tmp_path / "nope"))
    assert res.returncode != 0 and "does not exist" in res.stderr and res.stderr.strip().count("\n") == 0


def taskgen_file(tmp_path, n=2):
    """A DICE .json task file with reference solutions (the curriculum generator's)."""
    from dice.taskgen import generate_split
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(generate_split(n, 0, 0, seed=0)[0]))
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_evaluate_without_gpu_checks_its_inputs_first_and_says_a_gpu_runs_the_kernels(tmp_path, refusal):
    """Issue 29: every input got "needs a CUDA GPU" on a CPU before it was looked at."""
    res = refusal("evaluate.py", "--tasks", str(taskgen_file(tmp_path)), "--solutions", "reference")
    assert res.returncode == 1 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "running the kernels needs a CUDA GPU" in res.stderr and "2 solutions were read" in res.stderr
    wrong = tmp_path / "wrong.json"
    wrong.write_text('[{"code": "x"}]')
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    for tasks, message in ((tmp_path / "nope", "no such task file or folder"), (empty, f"no tasks in {empty}"),
                           (wrong, "record 0: no 'pytorch_code' string")):
        res = refusal("evaluate.py", "--tasks", str(tasks), "--solutions", "reference")
        assert res.returncode == 1 and message in res.stderr and "GPU" not in res.stderr, res.stderr
    res = refusal("evaluate.py", "--tasks", str(EXAMPLES[0]), "--model", str(ROOT / "dice" / "assets" / "dice-tiny"))
    assert res.returncode == 1 and res.stderr.strip().count("\n") == 0 and "pass --save-solutions DIR" in res.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_evaluate_generates_on_a_cpu_for_verifying_later(tmp_path):
    """`--model ... --save-solutions DIR` generates without a GPU, then says how to verify on one."""
    tasks = taskgen_file(tmp_path, n=1)
    res = run("evaluate.py", "--tasks", str(tasks), "--model", str(ROOT / "dice" / "assets" / "dice-tiny"),
              "--save-solutions", str(tmp_path / "sol"), "--max-new-tokens", "64")
    assert res.returncode == 0, res.stderr
    (name,) = [t["id"] for t in json.loads(tasks.read_text())]
    assert (tmp_path / "sol" / "tasks" / f"{name}.py").is_file()
    assert f"--solutions {tmp_path / 'sol'}` on a GPU machine" in res.stderr


def test_evaluate_reads_solution_files_and_reference_code(tmp_path):
    import argparse

    sys.path.insert(0, str(ROOT))
    from evaluate import read_solutions
    from dice.tasks.load import Task

    tasks = [Task("level1/19_ReLU", 1, "src", solution="ref"), Task("level1/20_Tanh", 1, "src"),
             Task("level2/3_Fused", 2, "src")]
    (tmp_path / "level1").mkdir()
    (tmp_path / "level1" / "19_ReLU.py").write_text("one")
    (tmp_path / "level2" / "3_Fused").mkdir(parents=True)
    for j in range(3):
        (tmp_path / "level2" / "3_Fused" / f"sample_{j}.py").write_text(f"s{j}")
    got = read_solutions(argparse.Namespace(solutions=str(tmp_path)), tasks)
    assert [(t.name, code) for t, code in got] == [("level1/19_ReLU", "one"), ("level1/20_Tanh", None),
                                                  ("level2/3_Fused", "s0"), ("level2/3_Fused", "s1"),
                                                  ("level2/3_Fused", "s2")]
    ref = read_solutions(argparse.Namespace(solutions="reference"), tasks)
    assert [code for _, code in ref] == ["ref", None, None]


@pytest.mark.parametrize("args, message", [
    (["--phase", "e2e"], "--phase e2e needs --steps N"),
    (["--phase", "sft"], "--phase sft needs --steps N or --epochs E"),
    (["--phase", "sft", "--steps", "1", "--dtype", "fp16"], "--dtype: invalid choice: 'fp16'"),
    (["--phase", "sft", "--steps", "-1"], "--steps must be >= 0, got -1"),
    (["--phase", "e2e", "--steps", "1", "--reward", "foo"], "--reward: invalid choice: 'foo'"),
])
def test_train_flags_that_would_silently_do_nothing_are_one_line_errors(tmp_path, args, message, refusal):
    """RL without --steps ran no step and wrote an untrained final/; SFT without --steps/--epochs ran
    one step; an unknown --dtype meant fp32; --steps -1 wrote an untrained final/; an unknown
    --reward meant correct."""
    res = refusal("train.py", *args, "--model", str(tmp_path), "--data", str(tmp_path / "d.json"), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and message in res.stderr and res.stderr.strip().count("\n") == 0
    assert not (tmp_path / "o").exists()


SYSTEM_AND_ASSISTANT = {"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]}


@pytest.mark.parametrize("phase, data, message", [
    ("e2e", {"pytorch_code": "class Model: pass"}, r"holds an object, where a JSON list of task records \(objects with a pytorch_code field\) was expected; put the records in a list"),
    ("infill", EXAMPLES[0], "no task has the prefix/middle/suffix split the infill phase needs"),
])
def test_rl_bad_data_is_a_data_error(tmp_path, phase, data, message):
    """A task file that is a dict and tasks without the infill split ended in tracebacks. (train.py
    on a machine without a GPU stops earlier, at its GPU check, so this runs the RL entry with a
    Python reward.)"""
    import json
    from dice.errors import DataError
    from dice.rl.train_rl import train_rl
    from dice.config import TrainConfig
    if not isinstance(data, Path):
        data, records = tmp_path / "data.json", data
        data.write_text(json.dumps(records))
    cfg = TrainConfig(phase=phase, model=str(ROOT / "dice" / "assets" / "dice-tiny"), data=str(data),
                      out=str(tmp_path / "o"), steps=1, tasks_per_step=1)
    with pytest.raises(DataError, match=message):
        train_rl(cfg, reward_fn=lambda tasks, completions: [0.0] * len(completions))


@pytest.mark.parametrize("phase, data, message", [
    ("init", [SYSTEM_AND_ASSISTANT], "record 0 is not usable: its messages must end with a user turn"),
    ("sft", [SYSTEM_AND_ASSISTANT], "record 0 is not usable: its messages must end with a user turn"),
    ("sft", [{"pytorch_code": "class Model: pass"}], "record 0 is not usable: it has a pytorch_code task but no "
                                                     "cuda_code solution"),
    ("sft", [], "holds no records; give --data a JSON list"),
])
def test_train_bad_data_is_a_one_line_error(tmp_path, phase, data, message, refusal):
    """A chat record without a user turn ended in a traceback."""
    import json
    if not isinstance(data, Path):
        data, records = tmp_path / "data.json", data
        data.write_text(json.dumps(records))
    model = ROOT / "dice" / "assets" / "dice-tiny"
    training = [] if phase == "init" else ["--model", str(model), "--steps", "1"]   # init takes neither
    res = refusal("train.py", "--phase", phase, *training, "--data", str(data), "--out", str(tmp_path / "o"))
    assert res.returncode != 0 and message in res.stderr and res.stderr.strip().count("\n") == 0, res.stderr


def test_rl_with_fewer_tasks_per_step_than_processes_is_a_data_error(tmp_path, monkeypatch):
    from dice.cli import USER_ERRORS
    from dice.errors import DataError
    from dice.rl.train_rl import train_rl
    from dice.config import TrainConfig
    from dice.runtime import Runtime
    monkeypatch.setattr("dice.rl.train_rl.setup_runtime", lambda offload: Runtime(torch.device("cpu"), rank=0, world=2))
    cfg = TrainConfig(phase="e2e", model="unused", data="unused", out=str(tmp_path / "o"), steps=1, tasks_per_step=1)
    with pytest.raises(DataError, match="pass --tasks-per-step 2 or more") as caught:
        train_rl(cfg)
    assert isinstance(caught.value, USER_ERRORS)


def test_learning_rate_defaults_follow_the_phase():
    """DESIGN.md §7: BiC-RL uses AdamW lr 1e-6; SFT keeps 1e-5; an explicit --lr wins."""
    from dice.config import TrainConfig, config_from_args
    assert TrainConfig(phase="infill").lr == TrainConfig(phase="e2e").lr == 1e-6
    assert TrainConfig(phase="sft").lr == 1e-5
    assert config_from_args(["--phase", "e2e", "--lr", "3e-4"])[0].lr == 3e-4


def one_line_error(main, argv, capsys) -> str:
    """Run a command's main(argv) as its __main__ does; assert it fails with one line and return it."""
    from dice.cli import fail_cleanly
    with pytest.raises(SystemExit) as stop:
        fail_cleanly(lambda: main(argv))
    code = stop.value.code
    err = capsys.readouterr().err + (code if isinstance(code, str) else "")
    assert code not in (0, None) and err.strip() and err.strip().count("\n") == 0, err
    return err


def command(name):
    """The module of a top-level command (sample, train, evaluate)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return __import__(name)


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["--steps-per-block", "0"], "--steps-per-block: must be >= 1, got 0"),
    (["--temperature", "-1"], "--temperature: must be >= 0.0, got -1"),
    (["--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    (["--threshold", "1.5"], "--threshold: must be in [0, 1]"),
    (["--top-k", "-1"], "--top-k: must be >= 0"),
    (["--fused", "--device", "cpu"], "--fused: the fused kernel runs on a CUDA GPU"),
    (["--device", "foo"], "--device: use cpu, cuda or cuda:N, not 'foo'"),
    (["--remasking", "foo"], "--remasking: invalid choice: 'foo'"),
    (["--infill"], "--infill needs a task with a prefix/middle/suffix split and level1_leaky_relu has none"),
])
def test_sample_flag_errors_are_one_line_before_the_model_loads(capsys, args, message):
    """These were tracebacks from the sampler, rollout or torch, after loading the model."""
    err = one_line_error(command("sample").main, ["--prompt", str(EXAMPLES[0]), *args], capsys)
    assert message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_sample_on_cuda_without_a_gpu_is_one_line(capsys):
    err = one_line_error(command("sample").main, ["--prompt", str(EXAMPLES[0]), "--device", "cuda"], capsys)
    assert "this machine has no cuda GPU; use --device cpu" in err


def test_empty_task_file_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    err = one_line_error(command("sample").main, ["--prompt", str(empty)], capsys)
    assert f"{empty} holds no task" in err


@pytest.mark.parametrize("args, message", [
    (["--phase", "sft", "--steps", "1", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--phase", "sft", "--epochs", "-1"], "--epochs must be >= 0, got -1.0"),
    (["--phase", "e2e", "--steps", "1", "--remasking", "foo"], "--remasking: invalid choice: 'foo'"),
    (["--phase", "e2e", "--steps", "1", "--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
    (["--phase", "sft", "--steps", "1", "--model", "/nonexistent"], "--model /nonexistent does not exist"),
])
def test_train_flag_errors_are_one_line(tmp_path, capsys, args, message):
    argv = ["--model", str(tmp_path), "--data", str(tmp_path / "d.json"), "--out", str(tmp_path / "o"), *args]
    assert message in one_line_error(command("train").main, argv, capsys)
    assert not (tmp_path / "o").exists()


def test_train_config_rejects_unknown_reward_and_remasking():
    """dice.rl.train_rl only tests reward == "speedup": any other word silently meant "correct"."""
    from dice.config import TrainConfig
    with pytest.raises(ValueError, match="--reward must be one of correct, speedup"):
        TrainConfig(phase="e2e", reward="foo")
    with pytest.raises(ValueError, match="--remasking must be one of"):
        TrainConfig(remasking="low_confidence")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("args, message", [
    (["--phase", "e2e", "--steps", "1"], "--phase e2e rewards kernels with the verifier, which needs a CUDA GPU"),
    (["--phase", "sft", "--steps", "1", "--attention", "flex"], "--attention flex needs a CUDA GPU"),
])
def test_train_needing_a_gpu_fails_before_loading_the_model(tmp_path, capsys, args, message):
    argv = ["--model", str(tmp_path / "nope"), "--data", str(EXAMPLES[0]), "--out", str(tmp_path / "o"), *args]
    assert message in one_line_error(command("train").main, argv, capsys)


def test_init_with_an_unknown_record_is_a_one_line_data_error(tmp_path, refusal):
    """It was a KeyError traceback; fail_cleanly's errors exit with status 1, as its docstring says."""
    data = tmp_path / "rec.json"
    data.write_text('[{"prompt": "p", "response": "r"}, {"foo": 1}]')
    res = refusal("train.py", "--phase", "init", "--data", str(data), "--out", str(tmp_path / "o"))
    assert res.returncode == 1 and res.stderr.strip().count("\n") == 0, res.stderr
    assert f"{data}: record 1 is not a prompt/response, alpaca, messages or pytorch_code/cuda_code record" in res.stderr


def test_evaluate_flag_errors_are_one_line(capsys):
    argv = ["--tasks", str(EXAMPLES[0]), "--solutions", "reference", "--remasking", "foo"]
    assert "--remasking: invalid choice: 'foo'" in one_line_error(command("evaluate").main, argv, capsys)


def test_evaluate_reference_without_reference_solutions_is_one_line(tmp_path, capsys, monkeypatch):
    """A task .py has no cuda_code: every task was silently scored compile_error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # the checks come after the GPU check
    err = one_line_error(command("evaluate").main, ["--tasks", str(EXAMPLES[0]), "--solutions", "reference"], capsys)
    assert "--solutions reference takes the tasks' cuda_code and no task in" in err
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    err = one_line_error(command("evaluate").main, ["--tasks", str(empty), "--solutions", "reference"], capsys)
    assert err.strip() == f"error: no tasks in {empty}"
    err = one_line_error(command("evaluate").main, ["--tasks", str(empty), "--level", "2", "--solutions", "x"], capsys)
    assert err.strip() == f"error: no tasks in {empty} at level(s) [2]"


@pytest.mark.parametrize("shape", ["foo", "/nonexistent"])
def test_bench_unknown_shape_is_one_line(capsys, shape):
    from dice.bench import main
    err = one_line_error(main, ["train", "--shape", shape], capsys)
    assert f"--shape: {shape!r} is neither a shape (1.7b, 4b, 8b) nor a model folder with a config.json" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_bench_train_on_cpu_says_it_is_meant_for_a_gpu(capsys):
    from dice.bench import main
    main(["train", "--shape", str(ROOT / "tests/fixtures/tiny-sdar"), "--seq-len", "32", "--steps", "1",
          "--warmup", "0", "--grad-ckpt"])
    out, err = capsys.readouterr()
    assert "dice.bench train is meant for a CUDA GPU" in err and "HFU % (with recompute)" in out


@pytest.mark.parametrize("name, argv, shown", [
    ("sample", ["--help"], ["(default: 1024)", "(default: low_confidence_dynamic)", "~2.1x faster"]),
    ("train", ["--help"], ["--lr LR", "(default: sft 1e-5, infill/e2e 1e-6; embedded run", "{correct,speedup}",
                           "--steps STEPS", "(default: 0; embedded run (no --model/--data): sft 30, infill/e2e 6)"]),
    ("evaluate", ["--help"], ["default: 120)", "(default: 0 for one sample, else 1)"]),
    ("bench", ["train", "--help"], ["(default: 4096)"]),
])
def test_help_shows_defaults(capsys, monkeypatch, name, argv, shown):
    monkeypatch.setenv("COLUMNS", "200")
    if name == "bench":
        from dice.bench import main
    elif name == "train":
        from dice.config import config_from_args as main
    else:
        main = command(name).parse_args
    with pytest.raises(SystemExit) as stop:
        main(argv)
    text = capsys.readouterr().out
    assert stop.value.code == 0 and all(s in text for s in shown), text
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: )" not in text


def test_evaluate_infill_judges_the_skeleton_before_running():
    """--infill: a program that drops or edits the given prefix/suffix is invalid and never runs;
    one that keeps it goes to the verifier; without --infill the skeleton is not checked."""
    from dice.taskgen import generate_split
    from dice.tasks.load import Task
    evaluate = command("evaluate")
    record = generate_split(1, 0, 0, seed=0)[0][0]
    task = Task("t", record["level"], record["pytorch_code"], record["prefix"], record["middle"], record["suffix"])
    assert evaluate.verdict_without_running(task, record["cuda_code"], infill=True) is None
    edited_prefix = record["cuda_code"].replace("import torch\n", "import torch, os\n", 1)
    trailing_main = record["cuda_code"] + "\nif __name__ == '__main__':\n    print(ModelNew())\n"
    for program in (edited_prefix, trailing_main):
        verdict = evaluate.verdict_without_running(task, program, infill=True)
        assert verdict.status == "invalid" and not verdict.correct and "prefix and suffix" in verdict.message
        assert evaluate.verdict_without_running(task, program, infill=False) is None
    assert evaluate.verdict_without_running(task, None, infill=True).status == "compile_error"


def test_evaluate_infill_end_to_end_with_solution_files(tmp_path, capsys, fake_verifier):
    """main --infill: the task without a split is left out with a warning, the program that
    drops the skeleton is invalid and never reaches the verifier, the one that keeps it does."""
    import json

    from dice.taskgen import generate_split
    records = generate_split(2, 0, 0, seed=0)[0]
    records.append({k: v for k, v in records[0].items() if k not in ("prefix", "middle", "suffix")} | {"id": "plain"})
    data = tmp_path / "tasks.json"
    data.write_text(json.dumps(records))
    solutions = tmp_path / "solutions"
    (solutions / "tasks").mkdir(parents=True)     # a DICE task is named <file stem>/<id>
    (solutions / "tasks" / f"{records[0]['id']}.py").write_text(records[0]["cuda_code"])
    (solutions / "tasks" / f"{records[1]['id']}.py").write_text(
        records[1]["cuda_code"].replace("import torch\n", "import os\n", 1))
    out = tmp_path / "results.json"
    command("evaluate").main(["--tasks", str(data), "--solutions", str(solutions), "--infill", "--no-timing",
                              "--out", str(out)])
    assert "warning: --infill leaves out the 1 of 3 tasks without a prefix/middle/suffix split" in capsys.readouterr().err
    assert fake_verifier.candidates == [records[0]["cuda_code"]]
    status = {r["task"]: r["status"] for r in json.loads(out.read_text())["results"]}
    assert status == {f"tasks/{records[0]['id']}": "correct", f"tasks/{records[1]['id']}": "invalid"}


def test_evaluate_infill_without_split_tasks_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # the checks come after the GPU check
    err = one_line_error(command("evaluate").main, ["--tasks", str(EXAMPLES[0]), "--solutions", "reference",
                                                   "--infill"], capsys)
    assert "--infill needs tasks with a prefix/middle/suffix split and none of the 1 selected in" in err


def test_taskgen_out_that_is_a_file_is_one_line(tmp_path, capsys):
    from dice.taskgen import main
    target = tmp_path / "taken"
    target.write_text("keep me")
    err = one_line_error(main, ["--out", str(target), "--train", "3"], capsys)
    assert f"argument --out: {target} is a file" in err and target.read_text() == "keep me"


def test_progress_line_in_a_log_keeps_a_few_whole_lines(capsys):
    from dice.cli import ProgressLine
    line = ProgressLine(every_s=3600)
    for i in range(100):
        line.update(f"step {i}")
    line.close()
    assert capsys.readouterr().err.splitlines() == ["step 0", "step 99"]
    line = ProgressLine(every_s=3600)
    for i in range(100):
        line.update(f"step {i}", force=i == 42)
    line.close()
    assert capsys.readouterr().err.splitlines() == ["step 0", "step 42", "step 99"]


@pytest.mark.parametrize("samples", [1, 12])
def test_saved_solutions_read_back_as_generated(tmp_path, samples):
    """--save-solutions writes what read_solutions reads: the same programs, in order, per task;
    an answer without code reads back as one that verdict_without_running calls compile_error."""
    import argparse

    from dice.tasks.load import Task
    evaluate = command("evaluate")
    tasks = [Task("level1/19_ReLU", 1, "src"), Task("level2/3_Fused", 2, "src")]
    pairs = [(t, f"program {t.name} {k}" if (i, k) != (1, 0) else None)
             for i, t in enumerate(tasks) for k in range(samples)]
    evaluate.write_solutions(tmp_path, pairs, samples)
    back = evaluate.read_solutions(argparse.Namespace(solutions=str(tmp_path), tasks="x"), tasks)
    assert [(t.name, code or None) for t, code in back] == [(t.name, code) for t, code in pairs]
    assert evaluate.verdict_without_running(tasks[1], back[samples][1], infill=False).status == "compile_error"


def test_save_solutions_without_model_is_one_line(capsys):
    err = one_line_error(command("evaluate").main, ["--tasks", str(EXAMPLES[0]), "--solutions", "reference",
                                                   "--save-solutions", "x"], capsys)
    assert "argument --save-solutions: only with --model" in err


class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(entry, argv, monkeypatch):
    """The ArgumentParser a command builds, caught as it starts parsing."""
    import argparse

    def caught(self, *args, **kwargs):
        raise _Parser(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    with pytest.raises(_Parser) as got:
        entry(argv)
    return got.value.parser


def _readme_command_rows():
    """(command cell, the README line) of every row of README's table of commands."""
    import re
    rows = []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith(("| `python ", "| `torchrun ")):
            cell = line.split("` |")[0] + "`"
            text = " ".join(re.findall(r"`([^`]*)`", cell)).replace("\\|", "|")
            rows.append((re.sub(r"^torchrun --nproc_per_node N ", "python ", text), line))
    return rows


def _command_parsers(monkeypatch) -> dict:
    """The parser of every command README shows, by program: sample.py, evaluate.py, train.py,
    dice.taskgen, dice.metrics, "dice.metrics plot", "dice.metrics learnable" and "dice.bench <subcommand>"."""
    import dice.bench
    import dice.bench.verify
    import dice.metrics
    import dice.taskgen
    from dice.config import config_from_args
    bench = _parser_of(dice.bench.main, [], monkeypatch)
    subcommands = next(a for a in bench._actions if a.choices and "sample" in a.choices).choices
    return {"sample.py": _parser_of(command("sample").parse_args, [], monkeypatch),
            "evaluate.py": _parser_of(command("evaluate").parse_args, [], monkeypatch),
            "train.py": _parser_of(config_from_args, [], monkeypatch),
            "dice.taskgen": _parser_of(dice.taskgen.main, [], monkeypatch),
            "dice.metrics": _parser_of(dice.metrics.main, [], monkeypatch),
            "dice.metrics plot": _parser_of(dice.metrics.main, ["plot"], monkeypatch),
            "dice.metrics learnable": _parser_of(dice.metrics.main, ["learnable"], monkeypatch),
            "dice.bench verify": _parser_of(dice.bench.verify.main, [], monkeypatch),
            **{f"dice.bench {name}": p for name, p in subcommands.items() if name != "verify"}}


def test_readme_command_table_matches_the_parsers(monkeypatch):
    """Every flag in README's table of commands exists, and every default it shows (`[--flag 64]`, or one
    of the flag's choices) is the parser's default, or the flag's help names it (train.py's --lr:
    "0 = 1e-5 for SFT / 1e-6 for RL"); other words (N, DIR, results.json) are placeholders."""
    import re
    by_program = _command_parsers(monkeypatch)
    rows = _readme_command_rows()
    assert len(rows) >= 10
    for text, line in rows:
        words = text.removeprefix("python ").removeprefix("-m ").split()
        if words[0] == "dice.bench" and words[1] != "verify":   # "dice.bench sample|profile|train|model"
            names = [f"dice.bench {name}" for name in words[1].split("|")]
            assert set(names) <= set(by_program), line
            parsers = [by_program[name] for name in names]
        else:
            parsers = [by_program[" ".join(words[:2]) if " ".join(words[:2]) in by_program else words[0]]]
        actions = {opt: a for p in parsers for a in p._actions for opt in a.option_strings}
        flags = re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)
        for flag in flags:
            assert flag in actions, f"README shows {flag}, which the command does not take: {line}"
        for flag, value in re.findall(r"\[(--[a-z][a-z0-9-]*) ([^\]\s|]+)\]", text):
            action = actions[flag]
            try:
                same = float(value) == float(action.default)
            except (TypeError, ValueError):   # a word is a default only among choices; else a placeholder
                if not action.choices or value not in action.choices:
                    continue
                same = value == action.default
            assert same or re.search(rf"(?<![\w.+-]){re.escape(value)}(?![\w.])", action.help or ""), \
                f"README shows {flag} {value} as the default, the parser's is {action.default!r}: {line}"


DOCS = ("README.md", "dice/PERFORMANCE.md", "dice/assets/dice-tiny/README.md", "dice/fused/NOTES.md")


def _readme_commands(programs):
    """Every command README and the notes files (DOCS) show (code blocks, with `RL="..."`-style variables expanded, and inline
    code) of the given programs (`_command_parsers`' keys), as (program, its arguments)."""
    import re
    text = "\n".join((ROOT / doc).read_text() for doc in DOCS)
    pieces = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = [re.sub(r"\s#.*$", "", line) for line in block.splitlines()]
        joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
        variables = dict(re.findall(r'^(\w+)="([^"]*)"', joined, re.M))
        pieces.append(re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), joined))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    pieces += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    names = sorted(programs, key=len, reverse=True)     # "dice.bench sample" before any prefix of it
    program = "(" + "|".join(re.escape(n if n.endswith(".py") else "-m " + n) for n in names) + r")\b"
    return [(m.group(1).removeprefix("-m "), m.group(2)) for piece in pieces
            for m in re.finditer(program + r"([^;&`\n]*)", piece)]


def test_every_command_readme_shows_takes_its_flags(monkeypatch):
    """The commands that produced README's numbers (pipelines, benchmarks, checks) still parse: each
    flag they use is one their command takes."""
    import re
    parsers = _command_parsers(monkeypatch)
    commands = _readme_commands(parsers)
    assert {program for program, _ in commands} == set(parsers), "README shows every command"
    assert len(commands) > 30
    for program, args in commands:
        takes = {opt for a in parsers[program]._actions for opt in a.option_strings}
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", args):
            assert flag in takes, f"README runs {program} with {flag}, which it does not take: {program}{args}"


DICE_TINY = ROOT / "dice" / "assets" / "dice-tiny"


def test_a_truncated_tokenizer_json_is_one_line_naming_the_file(tmp_path, capsys):
    """Issue 29: `head -c 3000` of the tokenizer printed a traceback naming no file."""
    folder = tmp_path / "model"
    shutil.copytree(DICE_TINY, folder)
    (folder / "tokenizer.json").write_bytes((DICE_TINY / "tokenizer.json").read_bytes()[:3000])
    err = one_line_error(command("sample").main, ["--prompt", str(EXAMPLES[0]), "--model", str(folder)], capsys)
    assert f"{folder / 'tokenizer.json'} cannot be read (" in err and "truncated or corrupt: copy or download it" in err


def test_a_task_file_that_is_not_utf8_is_one_line_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "task.py"
    bad.write_bytes(EXAMPLES[0].read_bytes().replace(b"import torch", b"import torch  # caf\xe9", 1))
    err = one_line_error(command("sample").main, ["--prompt", str(bad)], capsys)
    assert f"{bad} is not UTF-8 text (byte " in err and "save it as UTF-8" in err


@pytest.mark.parametrize("name", ["sample", "evaluate"])
def test_out_into_a_missing_folder_is_a_usage_error_before_any_work(tmp_path, capsys, name):
    """sample.py --out no/such/dir/x.py failed only after the whole generation."""
    target = tmp_path / "no" / "such" / "x.py"
    source = ["--prompt", str(EXAMPLES[0])] if name == "sample" else ["--tasks", str(EXAMPLES[0]), "--solutions", "x"]
    with pytest.raises(SystemExit) as stop:
        command(name).main([*source, "--out", str(target)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"argument --out: the folder of {target} does not exist" in err
    assert "generating" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.slow
def test_train_rl_without_flags_on_a_cpu_says_the_reward_needs_a_gpu(tmp_path):
    """Issue 28: `python train.py --phase e2e` said "--model is required"; now it is the embedded
    default, and on a machine without a GPU one line says why it cannot run."""
    for phase in ("e2e", "infill"):
        res = subprocess.run([sys.executable, str(ROOT / "train.py"), "--phase", phase], capture_output=True,
                             text=True, cwd=tmp_path, timeout=300)
        assert res.returncode == 1 and res.stderr.strip().count("\n") == 0, res.stderr
        assert "rewards kernels with the verifier, which needs a CUDA GPU" in res.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, message", [
    (["--phase", "sft", "--data", "d.json"], "--model is required with --data (give neither to run the embedded"),
    (["--phase", "sft", "--model", "m"], "--data is required with --model"),
    (["--phase", "init", "--data", "d.json"], "--phase init needs --out"),
    (["--phase", "sft", "--resume"], "--resume needs --out DIR"),
    (["--phase", "sft", "--resume", "--overwrite", "--out", "o"], "--resume continues the run in --out and --overwrite"),
    (["--phase", "e2e", "--loss-norm", "batch"], "--loss-norm for --phase e2e must be one of step, response"),
])
def test_train_usage_errors_exit_2(tmp_path, args, message, refusal):
    res = refusal("train.py", *args, cwd=tmp_path)
    assert res.returncode == 2 and message in res.stderr and res.stderr.strip().count("\n") == 0, res.stderr


def test_train_help_marks_the_required_flags(capsys, monkeypatch):
    from dice.config import config_from_args
    monkeypatch.setenv("COLUMNS", "300")
    helps = {opt: a.help for a in _parser_of(config_from_args, [], monkeypatch)._actions for opt in a.option_strings}
    for flag, rule in (("--model", "required with --data"), ("--data", "required with --model and for --phase init"),
                       ("--out", "required for --phase init"), ("--steps", "required with --data")):
        assert rule in helps[flag], (flag, helps[flag])


@pytest.mark.slow
def test_a_refusal_reads_the_same_in_this_interpreter_as_in_a_fresh_one(tmp_path, refusal):
    """The `refusal` fixture (tests/conftest.py) against a fresh interpreter: the same exit status
    and output, for a usage error (status 2) and an unreadable input (status 1)."""
    statuses = []
    for args in (["--phase", "sft", "--steps", "-1"], ["--phase", "init", "--data", "nope.json", "--out", "o"]):
        fresh = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                               cwd=tmp_path, timeout=300)
        here = refusal("train.py", *args, cwd=tmp_path)
        assert (here.returncode, here.stdout, here.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
        statuses.append(here.returncode)
    assert statuses == [2, 1] and not list(tmp_path.iterdir())
