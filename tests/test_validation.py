"""The validation layer beyond the battery (tests/test_inputs.py): memory estimates against the
allocations they bound, --overwrite replacing only what a command writes, Ctrl-C's resume line,
train.py's --help by phase, evaluate.py's --out on a CPU, progress that ends at its total."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny-sdar"
DICE_TINY = ROOT / "dice" / "assets" / "dice-tiny"
EXAMPLE = ROOT / "dice" / "assets" / "examples" / "level1_leaky_relu.py"


def command(name):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return __import__(name)


def test_kv_cache_estimate_is_the_samplers_allocation():
    """2 layers x 2 kv heads x head_dim 16 in float32: 512 bytes a position of keys and values, plus 26
    of the sampler's rows; 3 prompts of 3 tokens and 7 new ones are 3 x 12 positions (whole blocks of
    4): 36 x 538 bytes, what `new_cache` and the sampler's Rows allocate."""
    from dice import load_model
    from dice.memory import kv_cache_bytes
    from dice.sampling.sampler import Rows
    model = load_model(TINY)
    assert kv_cache_bytes(model.config, 3, 3 + 7, 4) == 36 * (2 * 2 * 2 * 16 * 4 + 26) == 19368
    rows = Rows([[5, 6, 7]] * 3, 4, 7, model.config.mask_token_id, [0, 1, 2], "cpu")
    cache = model.new_cache(3, rows.x.shape[1])
    allocated = sum(t.numel() * t.element_size() for t in [*cache.k, *cache.v, rows.x, rows.pos, rows.step_map,
                                                           rows.valid, rows.generated])
    assert allocated == 19368


def test_memory_refusal_names_the_sizes_and_a_fit_passes(monkeypatch):
    from dice.memory import MemoryShortage
    from dice.refusals import check_fits
    monkeypatch.setattr("dice.memory.free_bytes", lambda device: 3 * 2 ** 30)
    check_fits({"weights": 2 ** 30, "the KV cache": 2 * 2 ** 30}, torch.device("cpu"), "lower --max-new-tokens")
    with pytest.raises(MemoryShortage, match=r"at least 3\.5 GiB on cpu \(weights 1\.0 GiB, the KV cache 2\.5 GiB\) "
                                             r"and 3\.0 GiB is free; lower --max-new-tokens"):
        check_fits({"weights": 2 ** 30, "the KV cache": 5 * 2 ** 29}, torch.device("cpu"), "lower --max-new-tokens")


def test_free_cpu_memory_is_at_most_the_machines():
    from dice.memory import free_bytes
    total = int(next(line for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemTotal")).split()[1]) * 1024
    assert 0 < free_bytes(torch.device("cpu")) <= total


def test_progress_ends_at_the_length_limit_not_at_the_last_blocks_end():
    """Prompts of 5 and 6 tokens (block 4) and 6 new tokens: the last blocks reach positions 7 and 8 past
    the prompts, cut to 6 each; the count generate reports ends at 2 x 6 (it said 7 + 8 = 15 of 12)."""
    from dice import load_model
    from dice.sampling.sampler import generate
    reported = []
    generate(load_model(TINY), [[5] * 5, [6] * 6], max_new_tokens=6, progress=reported.append)
    assert reported[-1] == 12 and reported == sorted(reported)


def test_taskgen_overwrite_replaces_its_four_files_and_nothing_else(tmp_path, capsys):
    from dice.taskgen import main
    (tmp_path / "train.json").write_text("[]")
    (tmp_path / "notes.txt").write_text("the user's")
    main(["--out", str(tmp_path), "--train", "3", "--valid", "0", "--heldout", "0", "--rl", "0", "--overwrite"])
    assert len(json.loads((tmp_path / "train.json").read_text())) == 3
    assert (tmp_path / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heldout.json", "notes.txt", "rl.json", "train.json",
                                                          "valid.json"]
    assert "drawing tasks: 3/3" in capsys.readouterr().err


def test_init_overwrite_of_a_model_folder_leaves_no_weights_of_the_old_config(tmp_path, capsys):
    """--phase init --overwrite into a trained model folder: its config, tokenizer and weights are
    replaced (weights of another config would not load); the user's other files stay."""
    from dice.model.checkpoint import has_weights, read_config
    folder = tmp_path / "model"
    shutil.copytree(DICE_TINY, folder)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"prompt": f"p {i}", "response": f"r {i}"} for i in range(20)]))
    command("train").main(["--phase", "init", "--data", str(data), "--out", str(folder), "--vocab-size", "300",
                           "--hidden-size", "32", "--overwrite"])
    assert not has_weights(folder) and read_config(folder).hidden_size == 32
    assert (folder / "README.md").is_file()


def test_save_solutions_overwrite_replaces_a_tasks_samples_whole(tmp_path):
    """An earlier run's 3 samples of a task, overwritten by a run of 2: reading back gives the 2."""
    import argparse

    from dice.tasks.load import Task
    evaluate = command("evaluate")
    task = Task("level1/1_X", 1, "src")
    evaluate.write_solutions(tmp_path, [(task, f"old {k}") for k in range(3)], 3)
    evaluate.write_solutions(tmp_path, [(task, f"new {k}") for k in range(2)], 2)
    back = evaluate.read_solutions(argparse.Namespace(solutions=str(tmp_path)), [task])
    assert [code for _, code in back] == ["new 0", "new 1"]


def test_sample_overwrite_replaces_the_out_file(tmp_path, monkeypatch, capsys):
    import dice.sampling.completion
    sample = command("sample")
    monkeypatch.setattr(sample, "complete", lambda model, tok, prompts, **kw: [
        dice.sampling.completion.Completion(list(prompts[0]), [], [], "", "class ModelNew: pass")])
    out = tmp_path / "kernel.py"
    out.write_text("the user's kernel")
    sample.main(["--prompt", str(EXAMPLE), "--out", str(out), "--device", "cpu", "--overwrite"])
    assert out.read_text() == "class ModelNew: pass\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_evaluate_out_on_a_cpu_lists_the_generated_programs_as_unverified(tmp_path, monkeypatch, capsys):
    """--out was not written at all on a CPU; now it lists every program, unverified, and dice.metrics
    says so instead of comparing it."""
    import dice.sampling.completion
    from dice.cli import fail_cleanly
    from dice.metrics import main as metrics
    monkeypatch.setattr(command("evaluate"), "complete", lambda model, tok, prompts, **kw: [
        dice.sampling.completion.Completion(list(p), [], [], "", "code") for p in prompts])
    tasks, out = tmp_path / "kb" / "level1", tmp_path / "results.json"
    tasks.mkdir(parents=True)
    for name in ("1_A", "2_B"):
        (tasks / f"{name}.py").write_text(EXAMPLE.read_text())
    command("evaluate").main(["--tasks", str(tmp_path / "kb"), "--model", str(DICE_TINY), "--save-solutions",
                              str(tmp_path / "s"), "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["verified"] is False and [r["task"] for r in written["results"]] == ["level1/1_A", "level1/2_B"]
    assert (tmp_path / "s" / "level1" / "1_A.py").read_text() == "code"
    with pytest.raises(SystemExit) as stop:
        fail_cleanly(lambda: metrics([str(out), str(out)]))
    assert "were not verified" in str(stop.value.code)


def fake_run(steps_saved: int | None):
    """A stand-in for train_sft that leaves a run (a checkpoint at `steps_saved`) and is interrupted."""
    def train_sft(cfg):
        out = Path(cfg.out)
        (out / "metrics.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        if steps_saved:
            step = out / "checkpoints" / f"step_{steps_saved:06d}"
            step.mkdir(parents=True)
            torch.save({"step": steps_saved, "optimizer": {}}, step / "trainer_state.pt")
            (out / "checkpoints" / "latest").write_text(step.name)
        raise KeyboardInterrupt
    return train_sft


def test_ctrl_c_prints_the_command_that_resumes_the_run(tmp_path, monkeypatch, capsys, addition_task):
    from dice.cli import fail_cleanly
    from dice.config import config_from_args
    train = command("train")
    model, data = addition_task
    argv = ["--phase", "sft", "--model", str(model), "--data", str(data), "--steps", "9", "--max-len", "64",
            "--out", str(tmp_path / "run"), "--save-every", "3"]
    monkeypatch.setattr(train, "train_sft", fake_run(3))
    with pytest.raises(SystemExit) as stop:
        fail_cleanly(lambda: train.main(argv))
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 130 and err.count("\n") == 0
    assert err.startswith("interrupted; step_000003 is saved; continue the run with: python train.py ")
    cfg, _ = config_from_args(err.split("python train.py ")[1].split())
    assert cfg.resume and cfg.out == str(tmp_path / "run") and cfg.steps == 9
    monkeypatch.setattr(train, "train_sft", fake_run(None))
    with pytest.raises(SystemExit):
        fail_cleanly(lambda: train.main([*argv[:-4], "--out", str(tmp_path / "other")]))
    assert "no checkpoint was written to" in capsys.readouterr().err


def test_train_help_lists_a_phases_flags_alone(capsys, monkeypatch):
    from dice.config import PHASE_FLAGS, config_from_args
    monkeypatch.setenv("COLUMNS", "200")

    def help_of(*argv):
        with pytest.raises(SystemExit):
            config_from_args([*argv, "--help"])
        return capsys.readouterr().out

    whole, sft, init = help_of(), help_of("--phase", "sft"), help_of("--phase", "init")
    assert all(f"--phase {group}:" in whole for group in PHASE_FLAGS) and "training (--phase sft, infill, e2e):" in whole
    assert "--epochs" in sft and "--tasks-per-step" not in sft and "--vocab-size" not in sft
    assert "(default: 1e-5)" in sft and "(default: 0; embedded run (no --model/--data): 30)" in sft
    assert "--vocab-size" in init and "--lr" not in init and "--data" in init
    assert len(sft.splitlines()) < len(whole.splitlines()) * 2 // 3


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_folder_is_refused_untouched(tmp_path, capsys):
    from dice.cli import fail_cleanly
    from dice.taskgen import main
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(SystemExit) as stop:
            fail_cleanly(lambda: main(["--out", str(folder / "o"), "--train", "2"]))
        assert stop.value.code == 2 and f"{folder} is not writable" in capsys.readouterr().err
        assert not list(folder.iterdir())
    finally:
        folder.chmod(0o755)


@pytest.mark.slow
def test_ctrl_c_of_a_real_run_resumes_with_the_printed_command(addition_task, tmp_path):
    """SIGINT to `python train.py` (as Ctrl-C sends it): exit status 130, one line naming the
    checkpoint and the command; that command continues the run to its end."""
    model, data = addition_task
    cmd = [sys.executable, str(ROOT / "train.py"), "--phase", "sft", "--model", str(model), "--data", str(data),
           "--out", str(tmp_path / "run"), "--steps", "12", "--save-every", "2", "--batch-size", "2", "--max-len", "64"]
    # SIGINT's default action restored: a shell's background job starts its children ignoring it
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stderr:
        if line.startswith("step 5/12"):
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, rest
    last = rest.strip().splitlines()[-1]
    assert last.startswith("interrupted; step_00000") and "--resume" in last and "Traceback" not in rest, rest
    resumed = subprocess.run([sys.executable, str(ROOT / "train.py"), *last.split("python train.py ")[1].split()],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr and "step 12/12" in resumed.stderr


@pytest.mark.gpu
def test_memory_on_a_gpu_is_cudas_free_memory_and_bounds_its_kv_cache():
    """On CUDA the free figure is the device's and the estimate is at most what the cache takes there
    (the allocator rounds each tensor up); a rollout cache of 10^9 tokens is refused up front."""
    from dice import load_model
    from dice.config import TrainConfig
    from dice.memory import MemoryShortage, free_bytes, kv_cache_bytes
    device = torch.device("cuda")
    assert 0 < free_bytes(device) <= torch.cuda.get_device_properties(device).total_memory
    model = load_model(TINY, device="cuda", dtype=torch.bfloat16)
    before = torch.cuda.memory_allocated(device)
    cache = model.new_cache(3, 12)
    kv_only = kv_cache_bytes(model.config, 3, 12, 2) - 3 * 12 * 26   # without the sampler's rows
    assert torch.cuda.memory_allocated(device) - before >= kv_only == 36 * 2 * 2 * 2 * 16 * 2
    del cache
    cfg = TrainConfig(phase="e2e", model=str(DICE_TINY), data=str(EXAMPLE), steps=1, max_new_tokens=10 ** 9)
    with pytest.raises(MemoryShortage, match="the rollout KV cache"):
        command("train").check_memory(cfg)
