"""A battery of bad inputs over every command (issue 35): train.py, sample.py, evaluate.py, dice.taskgen,
dice.metrics and dice.bench, one case per class the issue names, run in-process through the commands'
own `fail_cleanly` as their `__main__` runs them.

Each case must end as a one-line error with its exit status (2: a flag, a value, an output path; 1: an
input, a file's content, memory, the machine) and the phrase that names the input and the fix, and
leave the user's files byte for byte as they were: every case's folders are hashed before and after.
A failing case says which of the other outcomes it had: `traceback` (an exception escaped),
`silent` (exit status 0: the input was accepted), `several lines`, or `data loss` (a file changed).
"""
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import make_tiny_model_folder

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "dice" / "assets" / "examples" / "level1_leaky_relu.py"


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under `folder`: a file's sha256, or "folder"."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
            for path in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A user's workspace: a trained model folder, SFT records, a DICE task file with solutions, a
    KernelBench folder, earlier solutions and results, and a run with a checkpoint."""
    from dice.model.checkpoint import read_config, save_model
    from dice.model.sdar import SDAR
    from dice.taskgen import generate_split
    root = tmp_path_factory.mktemp("workspace")
    records = [{"prompt": f"add {a} and {a + 1}", "response": f"{2 * a + 1}"} for a in range(40)]
    (root / "sft.json").write_text(json.dumps(records))
    model = make_tiny_model_folder(root / "model", [r["prompt"] + r["response"] for r in records] * 3, hidden=32)
    save_model(SDAR(read_config(model)).init_weights(seed=0), model)
    (root / "tasks.json").write_text(json.dumps(generate_split(2, 0, 0, seed=0)[0]))
    (root / "kb" / "level1").mkdir(parents=True)
    shutil.copy(EXAMPLE, root / "kb" / "level1" / "1_LeakyRelu.py")
    (root / "solutions" / "level1").mkdir(parents=True)
    (root / "solutions" / "level1" / "1_LeakyRelu.py").write_text("# the user's earlier solution\n")
    (root / "results.json").write_text(json.dumps({"summary": {}, "results": [
        {"task": "level1/1_LeakyRelu", "level": 1, "correct": True}]}))
    run = root / "run"
    step = run / "checkpoints" / "step_000002"
    shutil.copytree(model, step)
    torch.save({"step": 2, "optimizer": {"state": {}, "param_groups": []}}, step / "trainer_state.pt")
    (run / "checkpoints" / "latest").write_text("step_000002")
    (run / "run.json").write_text(json.dumps({"--seed": 0}))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    return root


def cut(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[:int(path.stat().st_size * keep)])


def run_copy(ws, case, mutate: Callable[[Path], None]) -> None:
    shutil.copytree(ws / "run", case / "run")
    mutate(case / "run")


def model_copy(ws, case, config: dict | None = None, text: str | None = None) -> None:
    shutil.copytree(ws / "model", case / "m")
    if text is not None or config is not None:
        keys = json.loads((case / "m" / "config.json").read_text()) | (config or {})
        (case / "m" / "config.json").write_text(text if text is not None else json.dumps(keys))


def write(case, name: str, content) -> None:
    (case / name).parent.mkdir(parents=True, exist_ok=True)
    (case / name).write_text(content if isinstance(content, str) else json.dumps(content))


def task_records(ws, **changes) -> list:
    return [json.loads((ws / "tasks.json").read_text())[0] | changes]


def unwritable(folder: str):
    """os.access says `folder` is not writable (as a read-only mount is, even for root)."""
    def patch(monkeypatch, case):
        real, target = os.access, (case / folder).resolve()
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p).resolve() == target and mode & os.W_OK
                            else real(p, mode, **kw))
        (case / folder).mkdir(exist_ok=True)
    return patch


def denied(name: str, mode: int):
    """The case's file `name` is not writable (os.access says so, as for root on a read-only file), or
    (mode os.R_OK) not readable: reading it raises PermissionError."""
    def patch(monkeypatch, case):
        target, access, read_text = (case / name).resolve(), os.access, Path.read_text
        if mode & os.W_OK:
            monkeypatch.setattr(os, "access", lambda p, m, **kw: False if Path(p).resolve() == target and m & os.W_OK
                                else access(p, m, **kw))
        else:
            def refuse(path, *args, **kwargs):
                if path.resolve() == target:
                    raise PermissionError(13, "Permission denied", str(path))
                return read_text(path, *args, **kwargs)
            monkeypatch.setattr(Path, "read_text", refuse)
    return patch


def gpu_with(free: int):
    """A CUDA GPU with `free` bytes free (the checks before any kernel or model runs)."""
    def patch(monkeypatch, case):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr("dice.memory.free_bytes", lambda device: free)
    return patch


@dataclass
class Case:
    id: str
    command: str
    argv: str          # {ws}: the workspace, {case}: this case's own folder
    code: int
    says: str
    setup: Callable = field(default=lambda ws, case: None)
    patch: Callable = field(default=lambda monkeypatch, case: None)


SFT = "--phase sft --model {ws}/model --data {ws}/sft.json --steps 1 --max-len 64 --out {case}/o"
E2E = "--phase e2e --model {ws}/model --data {ws}/tasks.json --steps 1 --out {case}/o"
INIT = "--phase init --data {ws}/sft.json --vocab-size 300"
RESUME = "--phase sft --model {ws}/model --data {ws}/sft.json --steps 3 --max-len 64 --resume --out {case}/run"
SAMPLE = "--prompt {ws}/kb/level1/1_LeakyRelu.py --model {ws}/model --max-new-tokens 4"
EVAL = "--tasks {ws}/kb --solutions {ws}/solutions"
GEN = "--tasks {ws}/kb --model {ws}/model --max-new-tokens 4"
RL = "rl --reward python --shape {ws}/model --solutions {ws}/tasks.json --tasks-per-step 1 --group-size 2"
BAD_CONFIGS = {"hidden_size": ("384", "hidden_size must be a whole number >= 1, not '384'"),
               "block_size": (0, "block_size must be a whole number >= 1, not 0"),
               "num_key_value_heads": (3, "num_key_value_heads 3 does not divide num_attention_heads 4"),
               "mask_token_id": (-1, "mask_token_id must be a token id below vocab_size"),
               "head_dim": (7, "head_dim must be even (rotate-half RoPE), not 7"),
               "tie_word_embeddings": ("yes", "tie_word_embeddings must be true or false"),
               "num_hidden_layers": (1.5, "num_hidden_layers must be a whole number >= 1, not 1.5")}

CASES = [
    # train.py: values no run could mean
    *[Case(f"train {flag} {value}", "train", f"{SFT} {flag} {value}", 2, message) for flag, value, message in [
        ("--grad-clip", "0", "--grad-clip must be > 0, got 0.0"), ("--grad-clip", "nan", "--grad-clip must be a finite"),
        ("--warmup-ratio", "2", "--warmup-ratio must be in [0, 1], got 2.0"),
        ("--save-every", "-1", "--save-every must be >= 0"), ("--keep-checkpoints", "-2", "--keep-checkpoints must be >= 0"),
        ("--warmup", "-1", "--warmup must be >= 0"), ("--weight-decay", "-0.1", "--weight-decay must be >= 0"),
        ("--lr", "0", "--lr must be > 0, got 0.0"), ("--lr", "nan", "--lr must be a finite number"),
        ("--batch-size", "0", "--batch-size must be >= 1"), ("--grad-accum", "-1", "--grad-accum must be >= 0"),
        ("--max-len", "-5", "--max-len must be >= 0"), ("--max-len", "3", "--max-len 3 is below the block size 4"),
        ("--min-lr-ratio", "2", "--min-lr-ratio must be in [0, 1]"), ("--adam-beta2", "1", "--adam-beta2 must be in [0, 1)"),
        ("--seed", "-1", "--seed must be in [0, 4294967295]"), ("--epochs", "2", "--steps N and --epochs E both"),
        ("--dtype", "fp16", "--dtype: invalid choice: 'fp16'"), ("--steps", "abc", "--steps: invalid int value"),
        ("--vocab-size", "500", "--vocab-size is a flag of --phase init, which --phase sft does not use"),
        ("--tasks-per-step", "4", "--tasks-per-step is a flag of --phase infill/e2e")]],
    Case("train --epochs inf", "train", SFT.replace("--steps 1", "--epochs inf"), 2, "--epochs must be a finite number"),
    *[Case(f"init {flag} {value}", "train", f"{INIT} --out {{case}}/o {flag} {value}", 2, message)
      for flag, value, message in [
        ("--block-size", "0", "--block-size must be >= 1, got 0"), ("--num-heads", "0", "--num-heads must be >= 1"),
        ("--num-heads", "3", "--hidden-size 256 / --num-heads 3 must be a whole, even head width"),
        ("--hidden-size", "100", "--hidden-size 100 / --num-heads 4 must be a whole, even head width"),
        ("--num-kv-heads", "3", "--num-kv-heads 3 must divide --num-heads 4"),
        ("--vocab-size", "10", "--vocab-size must be >= 260"), ("--steps", "5", "--steps is a flag of --phase sft, "
                                                                                 "infill, e2e")]],
    *[Case(f"e2e {flag} {value}", "train", f"{E2E} {flag} {value}", 2, message) for flag, value, message in [
        ("--temperature", "0", "--temperature 0 samples every response of a group alike"),
        ("--group-size", "1", "--group-size 1 gives every group one reward"),
        ("--verify-timeout", "0", "--verify-timeout must be > 0"), ("--eval-every", "2", "--eval-every N and --eval-data"),
        ("--eval-data", "x.json", "--eval-every N and --eval-data"), ("--threshold", "1.5", "--threshold must be in [0, 1]"),
        ("--clip-eps", "-0.1", "--clip-eps must be in [0, 1)"), ("--kl-beta", "-1", "--kl-beta must be >= 0"),
        ("--tasks-per-step", "0", "--tasks-per-step must be >= 1"), ("--max-new-tokens", "0", "--max-new-tokens must be >= 1"),
        ("--epochs", "1", "--epochs is a flag of --phase sft, which --phase e2e does not use"),
        ("--steps", "0", "--phase e2e needs --steps N (RL steps to run)"),
        ("--minibatch-order", "random", "--minibatch-order: invalid choice: 'random'"),
        ("--sft-pad-targets", "", "--sft-pad-targets is a flag of --phase sft")]],
    # train.py: output paths
    Case("train --resume into a missing folder", "train", RESUME.replace("{case}/run", "{case}/typo"), 2,
         "--resume: {case}/typo does not exist, so there is no run to continue"),
    Case("train --resume into an empty folder", "train", RESUME, 2, "holds no run (no final, metrics.jsonl",
         setup=lambda ws, case: (case / "run").mkdir()),
    Case("train --out a file", "train", SFT, 2, "argument --out: {case}/o is a file; give a folder",
         setup=lambda ws, case: write(case, "o", "the user's notes")),
    Case("train --out inside --model", "train", SFT.replace("{case}/o", "{ws}/model/runs"), 2,
         "is inside the input --model"),
    Case("train --out the --model folder", "train", SFT.replace("{case}/o", "{ws}/model"), 2, "is the input --model"),
    Case("train --out unwritable", "train", SFT.replace("{case}/o", "{case}/ro/o"), 2,
         "argument --out: {case}/ro is not writable", patch=unwritable("ro")),
    Case("train --out holding an earlier run", "train", SFT, 2, "holds an earlier run (final); pass --resume",
         setup=lambda ws, case: (case / "o" / "final").mkdir(parents=True)),
    Case("train --overwrite of the run whose final/ is the --model", "train",
         "--phase sft --model {case}/o/final --data {ws}/sft.json --steps 1 --max-len 64 --out {case}/o --overwrite", 2,
         "--overwrite would replace {case}/o/final, which holds the input --model",
         setup=lambda ws, case: shutil.copytree(ws / "model", case / "o" / "final")),
    Case("init --out a trained model folder", "train", f"{INIT} --out {{ws}}/model", 2,
         "argument --out: {ws}/model already holds config.json, tokenizer.json"),
    Case("init --out a file", "train", f"{INIT} --out {{ws}}/sft.json", 2, "is a file; give a folder"),
    Case("embedded sft --out holding the user's tasks.json", "train", "--phase sft --out {case}/o", 2,
         "already holds tasks.json, which this command would replace",
         setup=lambda ws, case: write(case, "o/tasks.json", "[]")),
    # train.py: inputs and their contents
    Case("train --data a folder", "train", SFT.replace("{ws}/sft.json", "{ws}/kb"), 1,
         "--data {ws}/kb is a folder, not a file"),
    Case("train --data missing", "train", SFT.replace("{ws}/sft.json", "{ws}/nope.json"), 1, "does not exist"),
    Case("train --model a file", "train", SFT.replace("{ws}/model ", "{ws}/sft.json "), 1,
         "--model {ws}/sft.json is a file, not a folder"),
    Case("train --model missing", "train", SFT.replace("{ws}/model ", "{ws}/nope "), 1, "--model {ws}/nope does not exist"),
    Case("train --model without config.json", "train", SFT.replace("{ws}/model ", "{ws}/kb "), 1,
         "config.json not found"),
    *[Case(f"train config.json {key} {value!r}", "train", SFT.replace("{ws}/model ", "{case}/m "), 1, says,
           setup=lambda ws, case, key=key, value=value: model_copy(ws, case, {key: value}))
      for key, (value, says) in BAD_CONFIGS.items()],
    Case("train config.json cut", "train", SFT.replace("{ws}/model ", "{case}/m "), 1, "config.json is not valid JSON",
         setup=lambda ws, case: model_copy(ws, case, text='{"vocab_size": 3')),
    Case("train config.json a list", "train", SFT.replace("{ws}/model ", "{case}/m "), 1, "holds a list, where a JSON object of config keys was expected",
         setup=lambda ws, case: model_copy(ws, case, text="[1, 2]")),
    Case("train cuda_code 5", "train", SFT.replace("{ws}/sft.json", "{case}/d.json"), 1,
         "record 0 is not usable: its cuda_code must be a string, not a number (5)",
         setup=lambda ws, case: write(case, "d.json", [{"pytorch_code": "x", "cuda_code": 5}])),
    Case("train records that are strings", "train", SFT.replace("{ws}/sft.json", "{case}/d.json"), 1,
         "record 0 is a string, where a record (a JSON object) was expected", setup=lambda ws, case: write(case, "d.json", ["a", "b"])),
    Case("train a cut JSONL line", "train", SFT.replace("{ws}/sft.json", "{case}/d.jsonl"), 1,
         "d.jsonl is not valid JSONL (Unterminated string starting at line 2 column 17)", setup=lambda ws, case: write(case, "d.jsonl", '{"prompt": "a", "response": "b"}\n{"prompt": "a", "re')),
    Case("init --data missing", "train", f"{INIT} --out {{case}}/o".replace("sft.json", "nope.json"), 1, "does not exist"),
    *[Case(f"train --resume with {what}", "train", RESUME, 1, says, setup=lambda ws, case, m=mutate: run_copy(ws, case, m))
      for what, mutate, says in [
        ("a cut run.json", lambda run: cut(run / "run.json"), "run.json is not a JSON object of the run's settings"),
        ("a cut metrics.jsonl", lambda run: cut(run / "metrics.jsonl", 0.8), "metrics.jsonl line 2 is not a metrics record"),
        ("a cut trainer_state.pt", lambda run: cut(run / "checkpoints/step_000002/trainer_state.pt"),
         "trainer_state.pt is cut or corrupt"),
        ("a cut checkpoint", lambda run: cut(run / "checkpoints/step_000002/model.safetensors"),
         "model.safetensors is cut or corrupt"),
        ("an empty latest", lambda run: (run / "checkpoints/latest").write_text(""), "latest names , which is missing"),
        ("a latest naming ..", lambda run: (run / "checkpoints/latest").write_text(".."), "latest names .., which is"),
        ("no checkpoint", lambda run: shutil.rmtree(run / "checkpoints"), "holds a run without checkpoints")]],
    Case("train --batch-size 100000", "train", f"{SFT} --batch-size 100000 --max-len 1024", 1,
         "lower --batch-size or --max-len"),
    Case("train sizes over a small free memory", "train", SFT, 1, "GiB is free; lower --batch-size",
         patch=lambda monkeypatch, case: monkeypatch.setattr("dice.memory.free_bytes", lambda device: 2 ** 10)),
    Case("e2e --max-new-tokens 1000000000 on a GPU", "train", f"{E2E} --max-new-tokens 1000000000", 1,
         "the rollout KV cache", patch=gpu_with(80 * 2 ** 30)),
    Case("e2e --data missing on a GPU", "train", E2E.replace("tasks.json", "nope.json"), 1, "--data {ws}/nope.json does "
         "not exist", patch=gpu_with(80 * 2 ** 30)),
    Case("e2e on a CPU", "train", E2E, 1, "rewards kernels with the verifier, which needs a CUDA GPU"),
    Case("e2e --prompt-template missing on a GPU", "train", f"{E2E} --prompt-template {{ws}}/nope.txt", 1,
         "--prompt-template {ws}/nope.txt: no such file", patch=gpu_with(80 * 2 ** 30)),
    Case("e2e --prompt-template without the task's place", "train", f"{E2E} --prompt-template {{case}}/t.txt", 1,
         "--prompt-template {case}/t.txt:", setup=lambda ws, case: write(case, "t.txt", "no place for the task"),
         patch=gpu_with(80 * 2 ** 30)),
    # sample.py
    *[Case(f"sample {flag} {value}", "sample", f"{SAMPLE} {flag} {value}", 2, message) for flag, value, message in [
        ("--max-new-tokens", "0", "--max-new-tokens: must be >= 1"), ("--temperature", "nan", "must be a finite number"),
        ("--top-p", "0", "--top-p: must be in (0, 1]"), ("--threshold", "2", "--threshold: must be in [0, 1]"),
        ("--seed", "-1", "--seed: must be >= 0"), ("--top-k", "-1", "--top-k: must be >= 0"),
        ("--device", "cuda:x", "--device: use cpu, cuda or cuda:N"),
        ("--out", "{ws}/results.json", "--out: {ws}/results.json already exists; pass --overwrite"),
        ("--out", "{ws}/kb", "--out: {ws}/kb is a folder"), ("--out", "{ws}/nope/x.py", "the folder of {ws}/nope/x.py"),
        ("--out", "{ws}/kb/level1/1_LeakyRelu.py", "is the input --prompt"),
        ("--out", "{ws}/model/x.py", "is inside the input --model")]],
    Case("sample --out unwritable", "sample", f"{SAMPLE} --out {{case}}/ro/x.py", 2, "{case}/ro is not writable",
         patch=unwritable("ro")),
    Case("sample --prompt-template missing", "sample", f"{SAMPLE} --prompt-template {{ws}}/nope.txt", 1,
         "--prompt-template {ws}/nope.txt: no such file"),
    Case("sample --out the --prompt-template", "sample", f"{SAMPLE} --prompt-template {{case}}/t.txt --out {{case}}/t.txt "
         "--overwrite", 2, "is the input --prompt-template", setup=lambda ws, case: write(case, "t.txt", "{{pytorch_code}}")),
    Case("sample --max-new-tokens 1000000000", "sample", f"{SAMPLE} --max-new-tokens 1000000000", 1,
         "the KV cache"),
    Case("sample --prompt missing", "sample", SAMPLE.replace("kb/level1/1_LeakyRelu.py", "nope.py"), 1, "no such task file"),
    Case("sample --prompt not a task", "sample", SAMPLE.replace("{ws}/kb/level1/1_LeakyRelu.py", "{ws}/results.json"), 1,
         "holds an object, where a JSON list of task records (objects with a pytorch_code field) was expected"),
    Case("sample --prompt level abc", "sample", SAMPLE.replace("{ws}/kb/level1/1_LeakyRelu.py", "{case}/t.json"), 1,
         "its level must be a whole number >= 0", setup=lambda ws, case: write(case, "t.json", task_records(ws, level="abc"))),
    Case("sample --prompt level 1.5", "sample", SAMPLE.replace("{ws}/kb/level1/1_LeakyRelu.py", "{case}/t.json"), 1,
         "its level must be a whole number", setup=lambda ws, case: write(case, "t.json", task_records(ws, level=1.5))),
    Case("sample --prompt cuda_code 5", "sample", SAMPLE.replace("{ws}/kb/level1/1_LeakyRelu.py", "{case}/t.json"), 1,
         "its cuda_code must be a string", setup=lambda ws, case: write(case, "t.json", task_records(ws, cuda_code=5))),
    Case("sample --model a file", "sample", SAMPLE.replace("{ws}/model", "{ws}/sft.json"), 1, "is a file, not a folder"),
    Case("sample --model with a zero block size", "sample", SAMPLE.replace("{ws}/model", "{case}/m"), 1,
         "block_size must be a whole number >= 1, not 0",
         setup=lambda ws, case: model_copy(ws, case, {"block_size": 0})),
    # evaluate.py
    *[Case(f"evaluate {flag} {value}", "evaluate", f"{EVAL} {flag} {value}", 2, message) for flag, value, message in [
        ("--out", "{ws}/results.json", "--out: {ws}/results.json already exists; pass --overwrite"),
        ("--out", "{ws}/kb", "is a folder; give the path of a file"),
        ("--out", "{ws}/kb/level1/r.json", "is inside the input --tasks"),
        ("--out", "{ws}/solutions/r.json", "is inside the input --solutions"),
        ("--timeout", "-1", "--timeout: must be > 0"), ("--timeout", "0", "--timeout: must be > 0"),
        ("--workers", "0", "--workers: must be >= 1"), ("--level", "-1", "--level: must be >= 0"),
        ("--seed", "3", "--seed: only with --model"), ("--max-new-tokens", "8", "--max-new-tokens: only with --model"),
        ("--save-solutions", "{case}/s", "--save-solutions: only with --model")]],
    *[Case(f"evaluate --model {flag} {value}", "evaluate", f"{GEN} {flag} {value}", 2, message)
      for flag, value, message in [
        ("--save-solutions", "{ws}/solutions", "--save-solutions: {ws}/solutions already holds level1/1_LeakyRelu.py"),
        ("--save-solutions", "{ws}/kb", "--save-solutions: {ws}/kb is the input --tasks"),
        ("--save-solutions", "{ws}/sft.json", "--save-solutions: {ws}/sft.json is a file"),
        ("--samples", "0", "--samples: must be >= 1"), ("--batch-size", "0", "--batch-size: must be >= 1")]],
    Case("evaluate --tasks a task file, --save-solutions its KernelBench root", "evaluate",
         "--tasks {ws}/kb/level1/1_LeakyRelu.py --model {ws}/model --save-solutions {ws}/kb", 2,
         "already holds level1/1_LeakyRelu.py"),
    Case("evaluate --protocol dice with block 8", "evaluate", "--tasks {ws}/kb --model {case}/m --protocol dice "
         "--save-solutions {case}/s", 1, "--protocol dice decodes blocks of 4",
         setup=lambda ws, case: model_copy(ws, case, {"block_size": 8})),
    Case("evaluate --solutions empty", "evaluate", EVAL.replace("{ws}/solutions", "{case}/s"), 1,
         "holds no solution of the 1 tasks", setup=lambda ws, case: (case / "s").mkdir()),
    Case("evaluate --solutions a file", "evaluate", EVAL.replace("{ws}/solutions", "{ws}/sft.json"), 1,
         "is a file, not a folder"),
    Case("evaluate --solutions missing", "evaluate", EVAL.replace("{ws}/solutions", "{ws}/nope"), 1, "does not exist"),
    Case("evaluate --tasks missing", "evaluate", EVAL.replace("{ws}/kb", "{ws}/nope"), 1, "no such task file or folder"),
    Case("evaluate --tasks level abc", "evaluate", "--tasks {case}/t.json --solutions reference", 1,
         "its level must be a whole number", setup=lambda ws, case: write(case, "t.json", task_records(ws, level="x"))),
    Case("evaluate --model sizes over memory", "evaluate", f"{GEN} --save-solutions {{case}}/s --max-new-tokens 1000000000",
         1, "lower --batch-size or --max-new-tokens"),
    Case("evaluate --model on a CPU", "evaluate", GEN, 1, "running the kernels needs a CUDA GPU"),
    Case("evaluate --prompt-template missing", "evaluate", f"{GEN} --prompt-template {{ws}}/nope.txt", 1,
         "--prompt-template {ws}/nope.txt: no such file"),
    Case("evaluate --protocol kernelbench --timeout 5", "evaluate", f"{EVAL} --protocol kernelbench --timeout 5", 2,
         "--timeout: --protocol kernelbench verifies with 180"),
    # dice.taskgen
    Case("taskgen --out holding the user's train.json", "taskgen", "--out {case}/o --train 3", 2,
         "already holds train.json, which this command would replace", setup=lambda ws, case: write(case, "o/train.json", "[]")),
    Case("taskgen --out a file", "taskgen", "--out {ws}/sft.json --train 3", 2, "argument --out: {ws}/sft.json is a file"),
    Case("taskgen --out unwritable", "taskgen", "--out {case}/ro/o --train 3", 2, "is not writable",
         patch=unwritable("ro")),
    Case("taskgen --train -1", "taskgen", "--out {case}/o --train -1", 2, "--train: must be >= 0"),
    Case("taskgen nothing to draw", "taskgen", "--out {case}/o --train 0 --valid 0 --heldout 0 --rl 0", 2,
         "nothing to draw"),
    Case("taskgen a count over the free disk", "taskgen", "--out {case}/o --train 1000000 --valid 0 --heldout 0 --rl 0", 1,
         "1000000 tasks take about 3,906 MiB in --out {case}/o, whose disk has 1 MiB free; draw fewer (--train, "
         "--valid, --heldout, --rl), free some disk space, or choose an --out on another disk",
         patch=lambda monkeypatch, case: monkeypatch.setattr(
             "dice.taskgen.shutil.disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30 - 2**20, 2**20))),
    # dice.metrics
    *[Case(f"metrics {what}", "metrics", "{case}/a.json {ws}/results.json", 1, says,
           setup=lambda ws, case, content=content: write(case, "a.json", content)) for what, content, says in [
        ("correct 'no'", {"results": [{"task": "t", "level": 1, "correct": "no"}]}, "result 0 is not a verdict"),
        ("correct 1", {"results": [{"task": "t", "level": 1, "correct": 1}]}, "result 0 is not a verdict"),
        ("level '1'", {"results": [{"task": "t", "level": "1", "correct": True}]}, "result 0 is not a verdict"),
        ("no task", {"results": [{"level": 1, "correct": True}]}, "result 0 is not a verdict"),
        ("results not a list", {"results": {"t": True}}, "is not an `evaluate.py --out` file"),
        ("a cut file", '{"results": [{"task": "t",', "it is not valid JSON (Expecting"),
        ("unverified", {"verified": False, "solutions": "s", "results": []}, "were not verified")]],
    Case("metrics a missing file", "metrics", "{ws}/nope.json {ws}/results.json", 1, "nope.json does not exist"),
    Case("metrics a folder", "metrics", "{ws}/kb {ws}/results.json", 1, "is a folder"),
    Case("metrics --level -1", "metrics", "{ws}/results.json {ws}/results.json --level -1", 2, "--level: must be >= 0"),
    # dice.bench
    *[Case(f"bench {args}", "bench", args, 2, message) for args, message in [
        ("builds --solutions {ws}/tasks.json --jobs -1", "--jobs: must be >= 1"),
        ("builds --solutions {ws}/tasks.json --jobs 0", "--jobs: must be >= 1"),
        ("builds --solutions {ws}/tasks.json --limit 0", "--limit: must be >= 1"),
        (f"{RL} --tasks-per-step 0", "--tasks-per-step: must be >= 1"), (f"{RL} --broken 2", "--broken: must be in [0, 1]"),
        (f"{RL} --max-new-tokens 0", "--max-new-tokens: must be >= 1"), (f"{RL} --group-size 1", "--group-size: must be >= 2"),
        (f"{RL} --verify-timeout -1", "--verify-timeout: must be > 0"), (f"{RL} --rollout-batch 0", "--rollout-batch"),
        (f"{RL} --seed -3", "--seed: must be >= 0"), ("rl --solutions x.json --shape {ws}/nope", "is neither a shape"),
        ("train --seq-len 0", "--seq-len: must be >= 1"), ("train --steps 0", "--steps: must be >= 1"),
        ("sample --batch 0", "--batch: must be >= 1"), ("profile --repeats 0", "--repeats: must be >= 1"),
        ("verify --workers 0", "--workers: must be >= 1"), ("verify --check {ws}/tasks.json --log {ws}/tasks.json",
                                                            "--log: it is the --check file"),
        ("stability --verifiers 0", "--verifiers: must be >= 1"), ("nope", "invalid choice: 'nope'")]],
    Case("bench builds --solutions missing", "bench", "builds --solutions {ws}/nope.json", 1, "no such task file"),
    Case("bench rl --solutions missing", "bench", RL.replace("tasks.json", "nope.json"), 1, "no such task file"),
    Case("bench rl --solutions cut", "bench", RL.replace("{ws}/tasks.json", "{case}/t.json"), 1, "not valid JSON",
         setup=lambda ws, case: write(case, "t.json", '[{"pytorch_code": ')),
    # issue 44 item 5: JSON errors name line and column (no "at at"); refusals start with error: and name the fix
    Case("train --data a JSON string cut", "train", SFT.replace("{ws}/sft.json", "{case}/d.json"), 1,
         "d.json is not valid JSON (Unterminated string starting at line 2 column 13); fix it there",
         setup=lambda ws, case: write(case, "d.json", '[\n {"prompt": "a')),
    Case("bench rl --solutions a JSON string cut", "bench", RL.replace("{ws}/tasks.json", "{case}/t.json"), 1,
         "t.json is not valid JSON (Unterminated string starting at line 1 column 19); fix it there",
         setup=lambda ws, case: write(case, "t.json", '[{"pytorch_code": "x')),
    Case("train --resume a run.json cut", "train", RESUME, 1,
         "run.json is not a JSON object of the run's settings (Expecting ',' delimiter at line 1 column 14); restore it",
         setup=lambda ws, case: run_copy(ws, case, lambda run: (run / "run.json").write_text('{"--seed": 0 "x": 1}'))),
    Case("bench builds --solutions without load_inline", "bench", "builds --solutions {case}/t.json", 1,
         "t.json: none of its 1 cuda_code programs builds a CUDA extension with torch's load_inline",
         setup=lambda ws, case: write(case, "t.json", task_records(ws, cuda_code="print('no kernel here')"))),
    Case("bench rl --rollout-batch 0 says its range", "bench", f"{RL} --rollout-batch 0", 2,
         "--rollout-batch: must be auto or a whole number >= 1, got 0"),
    Case("init --out a run folder", "train", f"{INIT} --out {{ws}}/run", 2,
         "argument --out: {ws}/run holds a training run (metrics.jsonl, checkpoints, run.json); --phase init writes a "
         "new model folder: choose another --out"),
    Case("train without --out where the default folder is unwritable", "train",
         SFT.replace(" --out {case}/o", ""), 2,
         "the default output folder runs/sft-",
         patch=lambda monkeypatch, case: unwritable(".")(monkeypatch, case)),
    Case("evaluate --out an unwritable file with --overwrite", "evaluate", f"{EVAL} --out {{case}}/r.json --overwrite", 2,
         "argument --out: {case}/r.json is not writable (permission denied), so --overwrite cannot replace it; fix its "
         "permissions or choose another path", setup=lambda ws, case: write(case, "r.json", "{}"),
         patch=denied("r.json", os.W_OK)),
    Case("metrics an unreadable results file", "metrics", "{case}/a.json {ws}/results.json", 1,
         "{case}/a.json is not readable (permission denied); fix its permissions, or give the file `evaluate.py --out` "
         "wrote", setup=lambda ws, case: write(case, "a.json", "{}"), patch=denied("a.json", os.R_OK)),
    Case("metrics a results file that is no results JSON", "metrics", "{case}/a.json {ws}/results.json", 1,
         "a.json is not an `evaluate.py --out` file (JSON with a 'results' list of task verdicts); give the file",
         setup=lambda ws, case: write(case, "a.json", [1, 2])),
    Case("bench rl sizes over memory", "bench", f"{RL} --max-new-tokens 1000000000", 1, "the rollout KV cache"),
    Case("bench profile on a CPU", "bench", "profile", 1, "needs a CUDA GPU"),
]


def entry(name: str):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if name in ("train", "sample", "evaluate"):
        return __import__(name).main
    import dice.bench
    import dice.metrics
    import dice.taskgen
    return {"taskgen": dice.taskgen.main, "metrics": dice.metrics.main, "bench": dice.bench.main}[name]


def outcome(main, argv: list[str], capsys) -> tuple[str, int | None, str]:
    """(what happened, exit status, stderr) of `main(argv)` run as the commands' __main__ runs it."""
    from dice.cli import fail_cleanly
    capsys.readouterr()
    try:
        fail_cleanly(lambda: main(argv))
        code = 0
    except SystemExit as stop:
        code = stop.code
    except BaseException as e:   # what fail_cleanly lets through is a traceback
        return "traceback", None, f"{type(e).__name__}: {e}"
    err = capsys.readouterr().err + (code if isinstance(code, str) else "")
    code = 1 if isinstance(code, str) else code or 0
    if code == 0:
        return "silent", 0, err
    return ("one-line" if err.strip() and err.strip().count("\n") == 0 else "several lines"), code, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the battery's machine checks are those of a CPU-only machine")
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_bad_input_is_one_line_and_leaves_every_file_as_it_was(case, ws, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)           # a default runs/ folder lands in the case's own folder
    case.setup(ws, tmp_path)
    case.patch(monkeypatch, tmp_path)
    before = {folder: snapshot(folder) for folder in (ws, tmp_path)}
    argv = [a.format(ws=ws, case=tmp_path) for a in case.argv.split()]
    what, code, err = outcome(entry(case.command), argv, capsys)
    after = {folder: snapshot(folder) for folder in (ws, tmp_path)}
    if any(after[folder].get(path) != digest for folder, paths in before.items() for path, digest in paths.items()):
        what = "data loss"            # a file or folder of the user's changed or went
    elif what == "one-line" and after != before:
        what = "a refusal that wrote"
    assert what == "one-line", f"{what} (exit status {code}): {err}"
    assert code == case.code, f"exit status {code}, not {case.code}: {err}"
    assert case.says.format(ws=ws, case=tmp_path) in err, err
    prog = err.split(": error: ", 1)[0] if ": error: " in err else None      # argparse's `prog: error: ...`
    assert err.startswith("error: ") or prog in ("train.py", "sample.py", "evaluate.py") or prog.startswith(
        "python -m dice."), err
