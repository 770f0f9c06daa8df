"""The configuration of `python train.py`: one dataclass whose fields are the flags (DESIGN.md §4, §7).

Every field of `TrainConfig` is a `--flag` (`config_from_args`); CHOICES and AT_LEAST bound the
values, HELP is the --help text. Phase defaults that depend on the phase (the learning rate) are
filled in `__post_init__`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .cli import ArgumentParser
from .sampler import REMASKING


@dataclass
class TrainConfig:
    """Flags of `python train.py`: every field is a `--flag`; CHOICES and AT_LEAST below bound their
    values, HELP is their --help text (see also README)."""
    phase: str = "sft"
    model: str = ""
    data: str = ""
    out: str = ""
    steps: int = 0
    epochs: float = 0.0
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 0.0
    min_lr_ratio: float = 0.1
    warmup: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_len: int = 2048
    dtype: str = "auto"
    save_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    seed: int = 0
    gradient_checkpointing: bool = False
    sft_infill: bool = False
    attention: str = "auto"
    # --phase init: a from-scratch model folder (tokenizer trained on --data, config, no weights)
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    block_size: int = 4
    # BiC-RL (dice.rl)
    tasks_per_step: int = 64
    group_size: int = 16
    max_new_tokens: int = 4096
    temperature: float = 1.0
    remasking: str = "low_confidence_dynamic"
    threshold: float = 0.9
    steps_per_block: int = 4
    rollout_batch: int = 64
    updates_per_step: int = 1
    clip_eps: float = 0.2
    kl_beta: float = 0.01
    reference_model: bool = False
    reward: str = "correct"
    eval_every: int = 0
    eval_data: str = ""
    verifier_workers: int = 8
    verify_timeout: float = 15.0

    def __post_init__(self):
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, "
                                 f"not {getattr(self, name)!r}")
        for name, low in AT_LEAST.items():
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if not self.lr:
            self.lr = 1e-6 if self.phase in ("infill", "e2e") else 1e-5


CHOICES = {"phase": ("init", "sft", "infill", "e2e"), "dtype": ("auto", "bf16", "fp32"),
           "attention": ("auto", "flex", "dense"), "remasking": REMASKING, "reward": ("correct", "speedup")}
AT_LEAST = {"steps": 0, "epochs": 0, "batch_size": 1, "grad_accum": 1, "tasks_per_step": 1, "group_size": 1,
            "max_new_tokens": 1, "temperature": 0, "steps_per_block": 1, "rollout_batch": 1, "updates_per_step": 1}
HELP = {
    "phase": "init: a from-scratch model folder; sft: masked-diffusion SFT; infill, e2e: the BiC-RL phases",
    "model": "the model folder to train (not for --phase init)",
    "data": "SFT records (.json/.jsonl), RL tasks (DICE .json or a KernelBench folder), or init's corpus",
    "out": "run folder (metrics.jsonl, checkpoints/, final/); for --phase init the new model folder",
    "steps": "optimiser steps (SFT: this or --epochs; RL: required)",
    "epochs": "SFT passes over the data, when --steps is 0",
    "batch_size": "rows per process per micro-batch (RL: trace rounds per micro-batch)",
    "grad_accum": "SFT micro-batches per optimiser step",
    "lr": "peak learning rate; 0 = 1e-5 for SFT / 1e-6 for RL (DESIGN.md §7)",
    "min_lr_ratio": "the cosine schedule decays to this fraction of --lr",
    "warmup": "linear warm-up steps",
    "weight_decay": "AdamW weight decay of the matrices",
    "grad_clip": "gradient-norm clipping",
    "max_len": "SFT row length in tokens (rounded down to the block size)",
    "dtype": "auto: bf16 autocast on CUDA, fp32 on CPU",
    "save_every": "write a checkpoint every N steps (0: only final/)",
    "keep_checkpoints": "checkpoints kept, newest first (0: all)",
    "resume": "continue from the newest checkpoint in --out",
    "seed": "seed of the initialisation, data order and noise",
    "gradient_checkpointing": "recompute each layer's forward in the backward pass (less memory)",
    "sft_infill": "also teach kernel records under the infilling prompt",
    "attention": "SFT masks: flex (FlexAttention, CUDA only) or dense; auto: flex on CUDA",
    "vocab_size": "--phase init: BPE vocabulary size",
    "hidden_size": "--phase init: hidden size",
    "num_layers": "--phase init: decoder layers",
    "num_heads": "--phase init: attention heads",
    "num_kv_heads": "--phase init: key/value heads",
    "intermediate_size": "--phase init: MLP width",
    "block_size": "--phase init: diffusion block size",
    "tasks_per_step": "RL: tasks per step, in curriculum order",
    "group_size": "RL: samples per task (one advantage group)",
    "max_new_tokens": "RL: tokens generated per sample",
    "temperature": "RL: sampling temperature",
    "remasking": "RL: the sampler's remasking rule",
    "threshold": "RL: confidence threshold of low_confidence_dynamic",
    "steps_per_block": "RL: denoising steps per block",
    "rollout_batch": "RL: sequences generated per batch",
    "updates_per_step": "RL: optimiser steps per RL step",
    "clip_eps": "RL: PPO clip range",
    "kl_beta": "RL: weight of the k3 KL term",
    "reference_model": "RL: KL against a frozen copy of --model instead of the rollout policy",
    "reward": "RL: correct (1 for a correct kernel, else 0) or speedup (adds 0.5 * clamp(log2 speedup, 0, 2))",
    "eval_every": "RL: greedy evaluation on --eval-data every N steps (0: never)",
    "eval_data": "RL: held-out tasks for --eval-every",
    "verifier_workers": "RL: kernel verifier worker processes",
    "verify_timeout": "RL: seconds a sampled kernel may run before it is a timeout",
}


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    """argparse over the TrainConfig fields: `--batch-size 8`, `--resume`, ..."""
    parser = ArgumentParser(prog="train.py", description="SFT and BiC-RL training (see README)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", default=f.default, help=HELP[f.name])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, type=kind, default=f.default, choices=CHOICES.get(f.name), help=HELP[f.name])
    try:
        return TrainConfig(**vars(parser.parse_args(argv)))
    except ValueError as e:
        parser.error(str(e))
