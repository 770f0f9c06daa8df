"""Train a DICE model: `python train.py --phase init|sft|infill|e2e --model DIR --data FILE --out DIR ...`.

Every flag is a field of `dice.config.TrainConfig`; README lists them. Under
`torchrun --nproc_per_node N train.py ...` the model is sharded with FSDP2.
"""
import sys
from pathlib import Path

import torch

from dice.cli import fail_cleanly
from dice.config import config_from_args
from dice.sft import init_model_folder, train_sft


def main(argv=None) -> None:
    cfg = config_from_args(argv)
    for flag in ("data", "out") if cfg.phase == "init" else ("model", "data", "out"):
        if not getattr(cfg, flag):
            sys.exit(f"train.py: --{flag} is required (see README)")
    if cfg.phase == "sft" and not (cfg.steps or cfg.epochs):
        sys.exit("train.py: --phase sft needs --steps N or --epochs E")
    if cfg.phase in ("infill", "e2e") and not cfg.steps:
        sys.exit(f"train.py: --phase {cfg.phase} needs --steps N (RL steps to run)")
    if cfg.phase in ("infill", "e2e") and not torch.cuda.is_available():
        sys.exit(f"train.py: --phase {cfg.phase} rewards kernels with the verifier, which needs a CUDA GPU "
                 "(and cupy) that this machine lacks; run it on a GPU machine")
    if cfg.phase == "sft" and cfg.attention == "flex" and not torch.cuda.is_available():
        sys.exit("train.py: --attention flex needs a CUDA GPU (FlexAttention has no CPU backward); "
                 "use --attention dense or auto on this machine")
    if cfg.phase != "init" and not Path(cfg.model).is_dir():
        sys.exit(f"train.py: model folder {cfg.model} does not exist; pass --model DIR (a downloaded "
                 "SDAR/DICE checkpoint, or a folder written by train.py)")
    if cfg.phase == "init":
        init_model_folder(cfg)
    elif cfg.phase == "sft":
        train_sft(cfg)
    else:
        from dice.rl import train_rl
        train_rl(cfg)


if __name__ == "__main__":
    fail_cleanly(main)
