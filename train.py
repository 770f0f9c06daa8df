"""Train a DICE model: `python train.py --phase init|sft|infill|e2e --model DIR --data FILE --out DIR ...`.

Every flag is a field of `dice.trainer.TrainConfig`; README lists them. Under
`torchrun --nproc_per_node N train.py ...` the model is sharded with FSDP2.
"""
import sys

from dice.cli import fail_cleanly
from dice.trainer import config_from_args, init_model_folder, train_sft


def main(argv=None) -> None:
    cfg = config_from_args(argv)
    for flag in ("data", "out") if cfg.phase == "init" else ("model", "data", "out"):
        if not getattr(cfg, flag):
            sys.exit(f"train.py: --{flag} is required (see README)")
    if cfg.attention not in ("auto", "flex", "dense"):
        sys.exit(f"train.py: --attention must be auto, flex or dense, not {cfg.attention!r}")
    if cfg.dtype not in ("auto", "bf16", "fp32"):
        sys.exit(f"train.py: --dtype must be auto, bf16 or fp32, not {cfg.dtype!r}")
    if cfg.phase == "sft" and not (cfg.steps or cfg.epochs):
        sys.exit("train.py: --phase sft needs --steps N or --epochs E")
    if cfg.phase in ("infill", "e2e") and not cfg.steps:
        sys.exit(f"train.py: --phase {cfg.phase} needs --steps N (RL steps to run)")
    if cfg.phase == "init":
        init_model_folder(cfg)
    elif cfg.phase == "sft":
        train_sft(cfg)
    elif cfg.phase in ("infill", "e2e"):
        from dice.rl import train_rl
        train_rl(cfg)
    else:
        sys.exit(f"train.py: --phase must be init, sft, infill or e2e, not {cfg.phase!r}")


if __name__ == "__main__":
    fail_cleanly(main)
