"""`python train.py --phase sft` end to end on a tiny from-scratch model (CPU): the loss, resume,
processes, run folders that are never overwritten, the embedded default, the optimiser."""
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
from dice.model.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--phase", "sft", "--batch-size", "4", "--max-len", "64", "--lr", "3e-3", "--warmup", "3", "--seed", "1"]


def train(model, data, out, *extra, launcher=(sys.executable,)):
    cmd = [*launcher, str(ROOT / "train.py"), "--model", str(model), "--data", str(data), "--out", str(out),
           *ARGS, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


def refused(refusal, model, data, out, *extra):
    """`train` of a command that stops before its first step, run in this interpreter (`refusal`)."""
    return refusal("train.py", "--model", str(model), "--data", str(data), "--out", str(out), *ARGS, *extra)


def losses(out):
    return [json.loads(l)["loss"] for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_finished_run_extends_from_its_last_step(addition_task, tmp_path):
    model, data = addition_task
    assert train(model, data, tmp_path, "--steps", "6", "--save-every", "4").returncode == 0
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000006"   # not only step 4
    res = train(model, data, tmp_path, "--steps", "8", "--save-every", "4", "--resume")
    assert res.returncode == 0, res.stderr
    assert "resumed from" in res.stderr and "step 6" in res.stderr.split("resumed from")[1].splitlines()[0]
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == list(range(1, 9))


@pytest.mark.slow
def test_two_process_gloo_matches_one_process(addition_task, tmp_path):
    """--loss-norm batch: a step's loss is the mean of its micro-batches' SDAR losses, so 2 processes x
    batch 2 equal 1 process x batch 2 x 2 accumulated micro-batches."""
    model, data = addition_task
    one = train(model, data, tmp_path / "one", "--steps", "4", "--batch-size", "2", "--grad-accum", "2")
    assert one.returncode == 0, one.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    two = train(model, data, tmp_path / "two", "--steps", "4", "--batch-size", "2", launcher=torchrun)
    assert two.returncode == 0, two.stderr
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    a, b = load_model(tmp_path / "one" / "final"), load_model(tmp_path / "two" / "final")
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_missing_model_folder_is_one_line(tmp_path, refusal):
    res = refused(refusal, tmp_path / "nope", tmp_path / "data.jsonl", tmp_path / "out", "--steps", "1")
    assert res.returncode != 0
    assert res.stderr.strip().count("\n") == 0 and "nope does not exist" in res.stderr, res.stderr


def test_unknown_attention_is_one_line(addition_task, tmp_path, refusal):
    model, data = addition_task
    res = refused(refusal, model, data, tmp_path / "out", "--steps", "1", "--attention", "sparse")
    assert res.returncode != 0
    assert res.stderr.strip().count("\n") == 0 and "--attention" in res.stderr, res.stderr


@pytest.mark.slow
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
    from dice.run_folder import save_checkpoint
    from dice.runtime import Runtime, make_optimizer
    model = load_model(TINY)
    optimizer = make_optimizer(model, TrainConfig(lr=1e-5))
    out = tmp_path / "out"
    return out, model, optimizer, lambda step, keep=2: save_checkpoint(out, step, model, optimizer, str(TINY),
                                                                       Runtime(torch.device("cpu")), keep)


def step_folders(out):
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_pruning_goes_by_step_number_and_keeps_the_checkpoint_just_written(tmp_path):
    from dice.run_folder import resume
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
    from dice.model.checkpoint import CheckpointError
    from dice.run_folder import resume
    out, model, optimizer, save = saver(tmp_path)
    save(4)
    (out / "checkpoints" / "latest").write_text("step_000008")
    with pytest.raises(CheckpointError, match=r"latest names step_000008, which is missing or incomplete"):
        resume(out, model, optimizer, print)


def test_a_new_run_in_an_out_with_checkpoints_is_a_one_line_error(addition_task, tmp_path, refusal):
    model, data = addition_task
    out = tmp_path / "out"
    (out / "checkpoints" / "step_000004").mkdir(parents=True)
    res = refused(refusal, model, data, out, "--steps", "1")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr   # an output path: usage
    assert f"{out} holds an earlier run (checkpoints); pass --resume to continue it, --overwrite" in res.stderr
    assert not (out / "metrics.jsonl").exists()


def snapshot(folder):
    """Every file under `folder` with its bytes."""
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(Path(folder).rglob("*")) if f.is_file()}


def one_line(res, code=1):
    """The error of a failed run: one line, after any progress lines, exit status `code` (2: an
    output path, 1: an input's content)."""
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == code and last.startswith("error: "), res.stderr
    return last


@pytest.mark.slow
def test_a_finished_run_is_never_overwritten_without_overwrite(addition_task, tmp_path, refusal):
    """Issue 29: a second run into a finished run's folder (no checkpoints: --save-every 0) exited 0,
    replaced final/ and truncated metrics.jsonl. Now it is refused and the folder is byte for byte
    as it was; --overwrite replaces the run; --resume of a run without checkpoints is refused."""
    model, data = addition_task
    out = tmp_path / "run"
    assert train(model, data, out, "--steps", "3").returncode == 0
    before = snapshot(out)
    assert {"metrics.jsonl", "run.json", "final/model.safetensors"} <= before.keys()
    other = tmp_path / "other.jsonl"
    other.write_text(data.read_text().splitlines()[0] + "\n")
    err = one_line(refused(refusal, model, other, out, "--steps", "1"), code=2)
    assert f"{out} holds an earlier run (final, metrics.jsonl, run.json); pass --resume to continue it, " \
           "--overwrite to replace it, or choose another --out" in err
    assert "has nothing to continue from" in one_line(refused(refusal, model, data, out, "--steps", "4", "--resume"))
    assert snapshot(out) == before
    assert train(model, other, out, "--steps", "1", "--overwrite").returncode == 0
    assert len(losses(out)) == 1 and snapshot(out)["final/model.safetensors"] != before["final/model.safetensors"]


@pytest.mark.slow
def test_resume_refuses_changed_settings_and_leaves_the_run_as_it_was(addition_task, tmp_path, refusal):
    """Issue 29: --resume with another --batch-size or --data continued silently; a --steps below the
    checkpoint's printed `steps 20..10` and rewrote final/. Each is now one line naming the setting,
    and the run folder is byte for byte unchanged."""
    model, data = addition_task
    out = tmp_path / "run"
    assert train(model, data, out, "--steps", "4", "--save-every", "2").returncode == 0
    before = snapshot(out)
    other = tmp_path / "other.jsonl"
    other.write_text(data.read_text().replace("add", "plus"))
    cases = [(("--batch-size", "2"), "--batch-size: the run was started with 4, this one has 2; resume with "
                                     "--batch-size 4, or start a new run in another --out"),
             (("--seed", "2"), "--seed: the run was started with 1, this one has 2; resume with --seed 1"),
             (("--loss-norm", "sample"), "--loss-norm: the run was started with batch, this one has sample"),
             (("--grad-accum", "2"), "micro-batches per step (--grad-accum x processes): the run was started with 1, "
                                     "this one has 2; resume with the same setting"),
             (("--max-len", "32"), "the row length: the run was started with 64, this one has 32")]
    for extra, message in cases:
        err = one_line(refused(refusal, model, data, out, "--steps", "6", "--resume", *extra))
        assert f"{out / 'run.json'}: {message}" in err, err
    err = one_line(refused(refusal, model, other, out, "--steps", "6", "--resume"))   # the data file, not two hashes
    assert f"{out / 'run.json'}: --data {other} holds other data than the run was started with (its contents' " \
           "sha256 differs from the one run.json keeps); resume with the data the run started with" in err, err
    err = one_line(refused(refusal, model, data, out, "--steps", "3", "--resume"))
    assert "--steps 3 is below step 4, where the newest checkpoint in" in err and "pass --steps 4 or more" in err
    assert snapshot(out) == before


@pytest.mark.slow
def test_a_run_that_fails_before_its_first_step_leaves_no_folder(addition_task, tmp_path, refusal):
    model, data = addition_task
    err = one_line(refused(refusal, model, data, tmp_path / "new", "--steps", "1", "--max-len", "8"))
    assert f"all 200 examples of {data} are longer than --max-len 8 tokens" in err and "larger --max-len" in err
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    assert f"{empty} holds no records" in one_line(refused(refusal, model, empty, tmp_path / "new", "--steps", "1"))
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_embedded_default_runs_on_a_cpu_with_no_other_flag(tmp_path):
    """Issue 28: `python train.py --phase sft --steps 3` from a fresh checkout: dice-tiny on generated
    tasks, CPU-sized rows (said in one line), a new runs/sft-<time>/ with metrics and a checkpoint."""
    res = subprocess.run([sys.executable, str(ROOT / "train.py"), "--phase", "sft", "--steps", "3"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"sft-\d{8}-\d{6}", run.name)
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (run / "checkpoints" / "latest").read_text() == "step_000003" and (run / "final" / "config.json").is_file()
    if not torch.cuda.is_available():
        assert "no CUDA GPU: --max-len 1024, which fits in a few GB" in res.stderr
    assert len(json.loads((run / "tasks.json").read_text())) > 100


def test_sft_sizes_fit_the_machine():
    from dice.config import TrainConfig
    from dice.sft.train_sft import sft_sizes
    cpu, note = sft_sizes(TrainConfig(), torch.device("cpu"))
    assert (cpu.batch_size, cpu.max_len) == (1, 1024) and note.startswith("no CUDA GPU: --max-len 1024, which fits")
    given, note = sft_sizes(TrainConfig(batch_size=3), torch.device("cpu"))
    assert given.batch_size == 3 and "--max-len 1024" in note and "--batch-size" not in note
    assert sft_sizes(TrainConfig(batch_size=3, max_len=64), torch.device("cpu"))[1] is None
    assert (cpu.grad_accum, sft_sizes(TrainConfig(grad_accum=3), torch.device("cpu"))[0].grad_accum) == (1, 3)
    # DICE's sdar_8b_full.yaml: cutoff_len 6144, per-device batch 1, no accumulation, 8 GPUs: 8 rows a step
    gpu, note = sft_sizes(TrainConfig(), torch.device("cuda"))
    assert (gpu.batch_size, gpu.max_len, gpu.grad_accum, note) == (1, 6144, 8, None)
    assert [sft_sizes(TrainConfig(), torch.device("cuda"), world)[0].grad_accum for world in (2, 8, 16)] == [4, 1, 1]
    assert sft_sizes(TrainConfig(batch_size=8, max_len=2048), torch.device("cuda"))[0].max_len == 2048


def test_optimizer_and_schedule_defaults_are_dices():
    """DESIGN.md §4, §7: AdamW betas (0.9, 0.999) (LLaMA-Factory / DICE RL configs), SFT lr constant
    after a linear warm-up (`constant_with_warmup`); cosine to min_lr_ratio is the option."""
    from dice.config import TrainConfig
    from dice.runtime import lr_at, make_optimizer
    model = load_model(TINY)
    assert {g["betas"] for g in make_optimizer(model, TrainConfig()).param_groups} == {(0.9, 0.999)}
    chosen = make_optimizer(model, TrainConfig(adam_beta1=0.8, adam_beta2=0.95, lr=3e-4))
    assert {(g["betas"], g["lr"]) for g in chosen.param_groups} == {((0.8, 0.95), 3e-4)}
    # Hugging Face's warm-up: lr * step / w from step 0 (lr 0 first), then lr
    constant = TrainConfig(lr=1e-5, warmup=4)
    assert [lr_at(s, 10, constant) for s in (0, 1, 3, 4, 9)] == pytest.approx([0, 2.5e-6, 7.5e-6, 1e-5, 1e-5])
    # DICE's warmup_ratio 0.03, rounded up: 3 steps of 100, 1 of 10
    assert TrainConfig().warmup_ratio == 0.03
    assert [lr_at(s, 100, TrainConfig(lr=1e-5)) for s in (0, 1, 2, 3)] == pytest.approx([0, 1e-5 / 3, 2e-5 / 3, 1e-5])
    assert [lr_at(s, 10, TrainConfig(lr=1e-5)) for s in (0, 1)] == pytest.approx([0, 1e-5])
    assert lr_at(0, 10, TrainConfig(lr=1e-5, warmup_ratio=0.0)) == 1e-5
    cosine = TrainConfig(lr=1e-5, warmup=4, schedule="cosine", min_lr_ratio=0.1)
    # after warm-up: 0.1 + 0.9 * (1 + cos(pi * (s - 4) / 6)) / 2 of lr
    assert [lr_at(s, 10, cosine) for s in (3, 4, 7, 10)] == pytest.approx([7.5e-6, 1e-5, 5.5e-6, 1e-6])
    with pytest.raises(ValueError, match="--adam-beta2 must be in"):
        TrainConfig(adam_beta2=1.0)


@pytest.mark.slow
def test_sample_norm_does_not_depend_on_how_a_step_is_split(addition_task, tmp_path):
    """--loss-norm sample is the mean over the step's samples: 4 rows in one micro-batch or in two."""
    model, data = addition_task
    whole = train(model, data, tmp_path / "a", "--steps", "2", "--loss-norm", "sample")
    split = train(model, data, tmp_path / "b", "--steps", "2", "--loss-norm", "sample", "--batch-size", "2",
                  "--grad-accum", "2")
    assert whole.returncode == 0 and split.returncode == 0, whole.stderr + split.stderr
    assert losses(tmp_path / "b") == pytest.approx(losses(tmp_path / "a"), rel=1e-5)
