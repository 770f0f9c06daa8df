"""`python train.py --phase sft` end to end on a tiny from-scratch model (CPU)."""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dice import load_model
from dice.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--phase", "sft", "--batch-size", "4", "--max-len", "64", "--lr", "3e-3", "--warmup", "3", "--seed", "1"]


def train(model, data, out, *extra, launcher=(sys.executable,)):
    cmd = [*launcher, str(ROOT / "train.py"), "--model", str(model), "--data", str(data), "--out", str(out),
           *ARGS, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


def losses(out):
    return [json.loads(l)["loss"] for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_and_final_folder_loads(addition_task, tmp_path):
    model, data = addition_task
    res = train(model, data, tmp_path, "--steps", "60")
    assert res.returncode == 0, res.stderr
    assert "starting from scratch" in res.stderr and "step 60/60" in res.stderr
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 61))
    assert all({"loss", "lr", "tokens_per_s"} <= r.keys() for r in records)
    curve = torch.tensor([r["loss"] for r in records])
    # the 1/p-weighted loss has rare large draws (small p): compare medians
    assert curve[-20:].median() < 0.7 * curve[:10].median()
    final = load_model(tmp_path / "final")
    tok = load_tokenizer(tmp_path / "final")
    assert tok.mask_token_id == final.config.mask_token_id


def test_resume_after_kill_continues_the_same_curve(addition_task, tmp_path):
    model, data = addition_task
    unbroken = tmp_path / "unbroken"
    assert train(model, data, unbroken, "--steps", "16").returncode == 0
    broken = tmp_path / "broken"
    cmd = [sys.executable, str(ROOT / "train.py"), "--model", str(model), "--data", str(data), "--out", str(broken),
           *ARGS, "--steps", "16", "--save-every", "4"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for line in proc.stderr:
        if line.startswith("step 10/16"):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert not (broken / "final").exists() or proc.returncode == 0
    assert not list((broken / "checkpoints").glob(".*.tmp"))
    res = train(model, data, broken, "--steps", "16", "--save-every", "4", "--resume")
    assert res.returncode == 0, res.stderr
    assert "resumed from" in res.stderr
    assert losses(broken) == losses(unbroken)
    a, b = load_model(unbroken / "final"), load_model(broken / "final")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_finished_run_extends_from_its_last_step(addition_task, tmp_path):
    model, data = addition_task
    assert train(model, data, tmp_path, "--steps", "6", "--save-every", "4").returncode == 0
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000006"   # not only step 4
    res = train(model, data, tmp_path, "--steps", "8", "--save-every", "4", "--resume")
    assert res.returncode == 0, res.stderr
    assert "resumed from" in res.stderr and "step 6" in res.stderr.split("resumed from")[1].splitlines()[0]
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == list(range(1, 9))


def test_two_process_gloo_matches_one_process(addition_task, tmp_path):
    model, data = addition_task
    one = train(model, data, tmp_path / "one", "--steps", "4", "--batch-size", "4")
    assert one.returncode == 0, one.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    two = train(model, data, tmp_path / "two", "--steps", "4", "--batch-size", "2", launcher=torchrun)
    assert two.returncode == 0, two.stderr
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    a, b = load_model(tmp_path / "one" / "final"), load_model(tmp_path / "two" / "final")
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_missing_model_folder_is_one_line(tmp_path):
    res = train(tmp_path / "nope", tmp_path / "data.jsonl", tmp_path / "out", "--steps", "1")
    assert res.returncode != 0
    assert res.stderr.strip().count("\n") == 0 and "nope does not exist" in res.stderr, res.stderr


def test_unknown_attention_is_one_line(addition_task, tmp_path):
    model, data = addition_task
    res = train(model, data, tmp_path / "out", "--steps", "1", "--attention", "sparse")
    assert res.returncode != 0
    assert res.stderr.strip().count("\n") == 0 and "--attention" in res.stderr, res.stderr


def test_train_bench_runs_sharded_under_torchrun():
    """`torchrun --nproc_per_node 2 -m dice.bench train`: FSDP2 over two gloo processes (the code path
    of a multi-GPU benchmark), one table from rank 0 counting both processes' rows."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    res = subprocess.run([*torchrun, "-m", "dice.bench", "train", "--shape", str(ROOT / "tests/fixtures/tiny-sdar"),
                          "--seq-len", "64", "--batch", "1", "--steps", "1", "--warmup", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("train bench:") == 1
    assert "2 process(es) x batch 1 x 64 tokens (128 doubled), FSDP2" in res.stdout
    header, values = (re.split(r"\s{2,}", line.strip()) for line in res.stdout.strip().splitlines()[-2:])
    assert dict(zip(header, values))["processes"] == "2"


TINY = ROOT / "tests" / "fixtures" / "tiny-sdar"


def saver(tmp_path):
    """save(step, keep) writes checkpoint `step` of a tiny model into tmp_path/out, as one process."""
    from dice.config import TrainConfig
    from dice.runtime import Runtime, make_optimizer, save_checkpoint
    model = load_model(TINY)
    optimizer = make_optimizer(model, TrainConfig(lr=1e-5))
    out = tmp_path / "out"
    return out, model, optimizer, lambda step, keep=2: save_checkpoint(out, step, model, optimizer, str(TINY),
                                                                       Runtime(torch.device("cpu")), keep)


def step_folders(out):
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_pruning_goes_by_step_number_and_keeps_the_checkpoint_just_written(tmp_path):
    from dice.runtime import resume
    out, model, optimizer, save = saver(tmp_path)
    save(999_999)
    save(1_000_000, keep=1)      # sorts before step_999999 by name
    assert step_folders(out) == ["latest", "step_1000000"]
    save(8)
    save(12)
    save(4)                      # an older step than the folders already there
    assert step_folders(out) == ["latest", "step_000004", "step_1000000"]
    assert (out / "checkpoints" / "latest").read_text() == "step_000004"
    assert resume(out, model, optimizer, print)[0] == 4


def test_an_existing_step_folder_is_replaced_by_the_new_checkpoint(tmp_path):
    from safetensors.torch import load_file
    out, model, _, save = saver(tmp_path)
    save(4)
    with torch.no_grad():
        model.model.norm.weight.fill_(3.0)
    save(4)
    assert step_folders(out) == ["latest", "step_000004"]     # no .tmp or .old folder left
    assert (load_file(out / "checkpoints" / "step_000004" / "model.safetensors")["model.norm.weight"] == 3.0).all()


def test_resume_with_latest_naming_a_missing_checkpoint_is_an_error(tmp_path):
    from dice.checkpoint import CheckpointError
    from dice.runtime import resume
    out, model, optimizer, save = saver(tmp_path)
    save(4)
    (out / "checkpoints" / "latest").write_text("step_000008")
    with pytest.raises(CheckpointError, match=r"latest names step_000008, which is missing or incomplete"):
        resume(out, model, optimizer, print)


def test_a_new_run_in_an_out_with_checkpoints_is_a_one_line_error(addition_task, tmp_path):
    model, data = addition_task
    out = tmp_path / "out"
    (out / "checkpoints" / "step_000004").mkdir(parents=True)
    res = train(model, data, out, "--steps", "1")
    assert res.returncode != 0 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "holds checkpoints of an earlier run; pass --resume" in res.stderr
    assert not (out / "metrics.jsonl").exists()
