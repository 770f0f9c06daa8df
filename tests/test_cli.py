"""The shipped commands on a CPU-only machine: README's main command and the one-line errors."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "dice" / "assets" / "examples").glob("*.py"))


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_readme_main_command_generates_a_kernel_without_downloads(tmp_path):
    out = tmp_path / "kernel.py"
    res = run("sample.py", "--prompt", str(EXAMPLES[0]), "--verify", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "class ModelNew" in res.stdout and "__global__" in res.stdout
    assert out.read_text().strip() == res.stdout.strip()
    assert "generating:" in res.stderr and "tokens/s" in res.stderr
    assert "verification needs a CUDA GPU" in res.stdout + res.stderr


def test_every_shipped_example_is_a_valid_task():
    from dice.tasks import load_tasks
    assert len(EXAMPLES) == 3
    for p in EXAMPLES:
        assert load_tasks(p)[0].source == p.read_text()


def test_bad_task_and_missing_model_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    res = run("sample.py", "--prompt", str(bad))
    assert res.returncode != 0 and res.stderr.strip().count("\n") == 0
    assert "defines no Model, get_inputs, get_init_inputs" in res.stderr
    res = run("sample.py", "--prompt", str(EXAMPLES[0]), "--model", str(tmp_path / "nope"))
    assert res.returncode != 0 and "does not exist" in res.stderr and res.stderr.strip().count("\n") == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_evaluate_without_gpu_is_one_line(tmp_path):
    res = run("evaluate.py", "--tasks", str(EXAMPLES[0]), "--solutions", "reference")
    assert res.returncode != 0 and "needs a CUDA GPU" in res.stderr and res.stderr.strip().count("\n") == 0


def test_evaluate_reads_solution_files_and_reference_code(tmp_path):
    import argparse

    sys.path.insert(0, str(ROOT))
    from evaluate import read_solutions
    from dice.tasks import Task

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
    (["--phase", "sft", "--steps", "1", "--dtype", "fp16"], "--dtype must be auto, bf16 or fp32"),
])
def test_train_flags_that_would_silently_do_nothing_are_one_line_errors(tmp_path, args, message):
    """RL without --steps ran no step and wrote an untrained final/; SFT without --steps/--epochs ran
    one step; an unknown --dtype meant fp32."""
    res = run("train.py", *args, "--model", str(tmp_path), "--data", str(tmp_path / "d.json"), "--out", str(tmp_path / "o"))
    assert res.returncode != 0 and message in res.stderr and res.stderr.strip().count("\n") == 0
    assert not (tmp_path / "o").exists()


SYSTEM_AND_ASSISTANT = {"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]}


@pytest.mark.parametrize("phase, data, message", [
    ("e2e", {"pytorch_code": "class Model: pass"}, "expected a JSON list of task records, got a dict"),
    ("infill", EXAMPLES[0], "no task has the prefix/middle/suffix split the infill phase needs"),
    ("init", [SYSTEM_AND_ASSISTANT], "record 0 is not a prompt/response"),
    ("sft", [SYSTEM_AND_ASSISTANT], "record 0 is not a prompt/response"),
])
def test_train_bad_data_is_a_one_line_error(tmp_path, phase, data, message):
    """A task file that is a dict, tasks without the infill split, and a chat record without a user
    turn each ended in a traceback."""
    import json
    if not isinstance(data, Path):
        data, records = tmp_path / "data.json", data
        data.write_text(json.dumps(records))
    model = ROOT / "dice" / "assets" / "dice-tiny"
    res = run("train.py", "--phase", phase, "--model", str(model), "--data", str(data), "--out", str(tmp_path / "o"),
              "--steps", "1")
    assert res.returncode != 0 and message in res.stderr and res.stderr.strip().count("\n") == 0, res.stderr


def test_rl_with_fewer_tasks_per_step_than_processes_is_a_data_error(tmp_path, monkeypatch):
    from dice.cli import USER_ERRORS
    from dice.data import DataError
    from dice.rl import train_rl
    from dice.trainer import Runtime, TrainConfig
    monkeypatch.setattr("dice.rl.setup_runtime", lambda: Runtime(torch.device("cpu"), rank=0, world=2))
    cfg = TrainConfig(phase="e2e", model="unused", data="unused", out=str(tmp_path / "o"), steps=1, tasks_per_step=1)
    with pytest.raises(DataError, match="pass --tasks-per-step 2 or more") as caught:
        train_rl(cfg)
    assert isinstance(caught.value, USER_ERRORS)


def test_learning_rate_defaults_follow_the_phase():
    """DESIGN.md §7: BiC-RL uses AdamW lr 1e-6; SFT keeps 1e-5; an explicit --lr wins."""
    from dice.trainer import TrainConfig, config_from_args
    assert TrainConfig(phase="infill").lr == TrainConfig(phase="e2e").lr == 1e-6
    assert TrainConfig(phase="sft").lr == 1e-5
    assert config_from_args(["--phase", "e2e", "--lr", "3e-4"]).lr == 3e-4
