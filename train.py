"""Train a DICE model: `python train.py --phase init|sft|infill|e2e [--model DIR --data FILE] [--out DIR] ...`.

Every flag is a field of `dice.config.TrainConfig`; README lists them. With neither --model nor
--data, `--phase sft|infill|e2e` runs the embedded default (`dice.config.EMBEDDED`): the shipped
dice-tiny on tasks `dice.taskgen` generates with a fixed seed, written into the run folder. The
run folder defaults to a new `runs/<phase>-<time>/`. Under `torchrun --nproc_per_node N train.py
...` the model is sharded with FSDP2.
"""
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from dice.cli import fail_cleanly, usage_error
from dice.config import EMBEDDED, EMBEDDED_SFT_TASKS, config_from_args, with_embedded_defaults
from dice.runtime import check_run_folder
from dice.sft import init_model_folder, train_sft


def check_usage(cfg, embedded: bool) -> None:
    """Missing or conflicting flags: one line, exit status 2."""
    if cfg.phase == "init":
        for flag in ("data", "out"):
            if not getattr(cfg, flag):
                usage_error("train.py", f"--phase init needs --{flag}")
        return
    if not embedded:
        for flag in ("model", "data"):
            if not getattr(cfg, flag):
                usage_error("train.py", f"--{flag} is required with --{'data' if flag == 'model' else 'model'} "
                                        "(give neither to run the embedded default)")
        if cfg.phase == "sft" and not (cfg.steps or cfg.epochs):
            usage_error("train.py", "--phase sft needs --steps N or --epochs E")
        if cfg.phase != "sft" and not cfg.steps:
            usage_error("train.py", f"--phase {cfg.phase} needs --steps N (RL steps to run)")
    if cfg.resume and not cfg.out:
        usage_error("train.py", "--resume needs --out DIR, the run folder to continue")


def check_machine(cfg) -> None:
    """What this machine or the model folder cannot do: one line, exit status 1."""
    if cfg.phase in ("infill", "e2e") and not torch.cuda.is_available():
        sys.exit(f"train.py: --phase {cfg.phase} rewards kernels with the verifier, which needs a CUDA GPU "
                         "(and cupy) that this machine lacks; run it on a GPU machine")
    if cfg.phase == "sft" and cfg.attention == "flex" and not torch.cuda.is_available():
        sys.exit("train.py: --attention flex needs a CUDA GPU (FlexAttention has no CPU backward); "
                         "use --attention dense or auto on this machine")
    if cfg.phase != "init" and not Path(cfg.model).is_dir():
        sys.exit(f"train.py: model folder {cfg.model} does not exist; pass --model DIR (a downloaded "
                         "SDAR/DICE checkpoint, or a folder written by train.py)")


def write_embedded_data(phase: str, out: Path) -> Path:
    """out/tasks.json: the embedded default's tasks, the same file for the same phase (fixed seed);
    written through a per-process temporary file, so processes under torchrun do not collide. RL
    tasks are drawn after dice-tiny's SFT split (EMBEDDED_SFT_TASKS), so that, as in rl.json, none
    is one of the tasks it was trained on."""
    from dice.taskgen import generate_split
    split, n = EMBEDDED[phase][1]
    train, _, _, rl = generate_split(n if split == "train" else EMBEDDED_SFT_TASKS, 0, 0, seed=0,
                                     n_rl=n if split == "rl" else 0)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tasks.json.{os.getpid()}"
    tmp.write_text(json.dumps(train if split == "train" else rl, indent=1))
    os.replace(tmp, out / "tasks.json")
    return out / "tasks.json"


def main(argv=None) -> None:
    cfg, given = config_from_args(argv)
    embedded = cfg.phase != "init" and not cfg.model and not cfg.data
    if embedded:
        cfg = with_embedded_defaults(cfg, given)
    check_usage(cfg, embedded)
    check_machine(cfg)
    if not cfg.out:
        cfg.out = f"runs/{cfg.phase}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(cfg.out)
    created = not out.exists()
    if cfg.phase != "init":
        check_run_folder(out, cfg.resume, cfg.overwrite)
    try:
        if embedded:
            kept = cfg.resume and (out / "tasks.json").is_file()   # a resumed run keeps its file as it is
            cfg.data = str(out / "tasks.json" if kept else write_embedded_data(cfg.phase, out))
            print(f"embedded default: {cfg.model} on {cfg.data}, run folder {out}", file=sys.stderr, flush=True)
        if cfg.phase == "init":
            init_model_folder(cfg)
        elif cfg.phase == "sft":
            train_sft(cfg)
        else:
            from dice.rl import train_rl
            train_rl(cfg)
    except BaseException:
        # a run that failed before its first step leaves no folder behind (only rank 0 removes it)
        if created and int(os.environ.get("RANK", "0")) == 0 and not (out / "metrics.jsonl").exists():
            shutil.rmtree(out, ignore_errors=True)
        raise


if __name__ == "__main__":
    fail_cleanly(main)
