"""The configuration of `python train.py`: one dataclass whose fields are the flags (DESIGN.md §4, §7).

Every field of `TrainConfig` is a `--flag` (`config_from_args`); CHOICES and RANGES bound the values
(`validate`), HELP (`dice.config_help`) is the --help text, grouped by the phases that use a flag
(PHASE_FLAGS: a flag given to a phase that does not use it is an error, not silently ignored).

Each default is set once. A field's default is its dataclass value; what a phase or the embedded run
uses instead is the one table DEFAULTS (phase -> {field: value}), applied to the fields not given:
a phase's row by `TrainConfig` itself, the embedded run's row on top by `with_embedded_defaults`
(`phase_defaults` merges them). AUTO fields' 0 is "auto", resolved where the machine is known (SFT's
row length and micro-batches per step: `dice.sft.train_sft.sft_sizes`; the RL update's budget:
`dice.memory.UpdateTokens`). The defaults are the originals' (DESIGN.md §4, §7): AdamW betas
(0.9, 0.999) and SFT lr 1e-5 constant after warm-up (deadlykitten4/DICE
`training/sft/llama_factory_sdar/examples/train_full_sdar/sdar_*_full.yaml`: `lr_scheduler_type:
constant_with_warmup`), SDAR's per-micro-batch token mean for SFT; for RL lr 1e-6, TraceRL's
per-step L1 normalisation, one optimiser step per 256 round rows, DICE's effective gradient clip and
a fresh AdamW per step (DICE's `training/RL/configs/rl_sdar_kernel_*.yaml`, DESIGN.md §7).

The fields stay flat, one per flag, in sections a reader scans: every phase's, training's, then the
RL settings a researcher tunes (the step, the sampler, the objective, the reward) on one screen,
then RL's machinery (memory, processes, evaluation), SFT's and init's. The parser, CHOICES, RANGES,
HELP, DEFAULTS, RESUME_FIELDS and run.json all name a setting by its flag. What the RL code needs as
one object is built from them: `sampling()` the rollouts' `Sampling`, and
`dice.rl.reward.rl_rewards` the reward with its verifier.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .cli import ArgumentParser
from .config_help import HELP
from .errors import UsageError
from .model.tokenizer import SPECIAL_TOKENS
from .sampling.choice import REMASKING, Sampling

UPDATE_ROWS = ("response", "round")   # --update-rows (`dice.model.packing`)


@dataclass(init=False)
class TrainConfig:
    """Flags of `python train.py`: every field is a `--flag`; CHOICES and RANGES below bound their
    values, HELP is their --help text, DEFAULTS what a phase uses in place of a default (see also
    README)."""
    # ---- every phase: what runs, on what, into where
    phase: str = "sft"
    model: str = ""
    data: str = ""
    out: str = ""
    overwrite: bool = False
    # ---- training (sft, infill, e2e): its length, the optimiser (dice.runtime: make_optimizer, lr_at), the loss
    steps: int = 0                  # required with --data; SFT: or --epochs
    lr: float = 1e-5
    grad_clip: float = 1.0          # inf: none
    loss_norm: str = "batch"        # SFT: batch | sample; RL: step | response (`validate`)
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    dtype: str = "auto"
    gradient_checkpointing: bool = False
    offload: str = "none"           # cpu: FSDP2 keeps the float32 state in host memory (dice.runtime.shard)
    attention: str = "auto"
    seed: int = 0
    # the run folder (dice.run_folder)
    save_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    # ---- BiC-RL (infill, e2e): what a researcher tunes, DESIGN.md §7 (and lr, grad_clip, loss_norm above:
    # RL's values in DEFAULTS)
    # the step: which tasks, how many samples of each
    tasks_per_step: int = 64
    group_size: int = 16
    task_order: str = "curriculum"
    dynamic_sampling_rounds: int = 0
    # the rollouts' sampler (`sampling()`) and response length
    max_new_tokens: int = 4096
    temperature: float = 1.0
    remasking: str = "low_confidence_dynamic"
    threshold: float = 0.9
    steps_per_block: int = 4
    # the objective (PPO-clip + k3, dice.rl.train_rl) and its optimiser steps
    clip_eps: float = 0.2
    kl_beta: float = 0.01
    reference_model: bool = False
    updates_per_step: int = 0       # 0: one per rows_per_update round rows
    rows_per_update: int = 256
    minibatch_order: str = "contiguous"
    optimizer_state: str = "step"
    # the reward (dice.rl.reward.rl_rewards)
    reward: str = "correct"
    reward_rules: str = "strict"
    verify_timeout: float = 15.0
    # ---- BiC-RL's machinery: memory and processes (no result depends on them), evaluation, the prompt
    rollout_batch: int = 64
    update_tokens: int = 0          # AUTO: from the free GPU memory (dice.memory.UpdateTokens)
    update_rows: str = "response"
    verifier_workers: int = 8
    eval_every: int = 0
    eval_data: str = ""
    prompt_template: str = ""
    # ---- SFT: data, batches, schedule
    epochs: float = 0.0
    batch_size: int = 1
    grad_accum: int = 0             # AUTO: by the device and processes (dice.sft.train_sft.sft_sizes)
    max_len: int = 0                # AUTO: by the device
    schedule: str = "constant"
    min_lr_ratio: float = 0.1
    warmup: int = 0                 # 0: warmup_ratio of the steps
    warmup_ratio: float = 0.03
    sft_infill: bool = False
    sft_pad_targets: bool = False
    # ---- --phase init: a from-scratch model folder (tokenizer trained on --data, config, no weights)
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    block_size: int = 4

    def __init__(self, **given):
        """A field's value: as given, else its phase's (DEFAULTS), else the dataclass default; then
        `validate`. (A written __init__: the generated one cannot tell a value given from a default.)"""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise TypeError(f"TrainConfig has no field {unknown[0]!r}")
        values = {f.name: f.default for f in dataclasses.fields(self)}
        values |= phase_defaults(given.get("phase", values["phase"])) | given
        for name in names:
            setattr(self, name, values[name])
        self.validate()

    def sampling(self) -> Sampling:
        """The RL rollouts' sampler settings (--steps-per-block, --remasking, --threshold, --temperature)."""
        return Sampling(steps_per_block=self.steps_per_block, remasking=self.remasking, threshold=self.threshold,
                        temperature=self.temperature)

    def validate(self) -> None:
        """Every value a run could not mean is a UsageError naming its flag: choices, RANGES, finite
        floats, a loss normalisation of another phase, a model shape whose heads do not divide
        (--phase init), greedy RL rollouts."""
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise UsageError(f"--{_flag(name)} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        for name, rule in RANGES.items():
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value) and not (name in ENDLESS and value == math.inf):
                raise UsageError(f"--{_flag(name)} must be a finite number, got {value}")
            if not _within(value, rule):
                raise UsageError(f"--{_flag(name)} must be {'in ' * (rule[0] in '[(')}{rule}, got {value}")
        norms = ("step", "response") if self.phase in RL_PHASES else ("batch", "sample")
        if self.loss_norm not in norms:
            raise UsageError(f"--loss-norm for --phase {self.phase} must be one of {', '.join(norms)}, "
                             f"not {self.loss_norm!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise UsageError(f"--hidden-size {self.hidden_size} / --num-heads {self.num_heads} must be a whole, even "
                             "head width (RoPE rotates pairs of its channels); change one of them")
        if self.num_heads % self.num_kv_heads:
            raise UsageError(f"--num-kv-heads {self.num_kv_heads} must divide --num-heads {self.num_heads} "
                             "(each key/value head serves a group of query heads); change one of them")
        if self.phase in RL_PHASES and self.temperature == 0:
            raise UsageError("--temperature 0 samples every response of a group alike, so no group has an "
                             "advantage and RL learns nothing; pass a --temperature above 0 (DICE: 1.0)")
        if self.resume and self.overwrite:
            raise UsageError("--resume continues the run in --out and --overwrite replaces it: pass one of them")


RL_PHASES = ("infill", "e2e")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _within(value, rule: str) -> bool:
    """`value` obeys `rule`: ">= x", "> x", "[a, b]" or "[a, b)"."""
    if rule[0] in "[(":
        low, high = (float(v) for v in rule[1:-1].split(","))
        above_low = low <= value if rule[0] == "[" else low < value
        return above_low and (value <= high if rule[-1] == "]" else value < high)
    op, bound = rule.split()
    return value >= float(bound) if op == ">=" else value > float(bound)

CHOICES = {"phase": ("init", "sft", "infill", "e2e"), "dtype": ("auto", "bf16", "fp32"),
           "schedule": ("constant", "cosine"), "attention": ("auto", "flex", "dense"), "remasking": REMASKING,
           "reward": ("correct", "speedup"), "reward_rules": ("strict", "dice"), "minibatch_order": ("contiguous", "shuffle"),
           "optimizer_state": ("step", "run"), "update_rows": UPDATE_ROWS,
           "task_order": ("curriculum", "interleaved"), "offload": ("none", "cpu")}
# the range of every number flag (`_within`); every float must be finite but those of ENDLESS
RANGES = {"steps": ">= 0", "epochs": ">= 0", "batch_size": ">= 1", "grad_accum": ">= 0", "lr": "> 0",
          "min_lr_ratio": "[0, 1]", "warmup": ">= 0", "warmup_ratio": "[0, 1]", "weight_decay": ">= 0",
          "adam_beta1": "[0, 1)", "adam_beta2": "[0, 1)", "grad_clip": "> 0", "max_len": ">= 0",
          "save_every": ">= 0", "keep_checkpoints": ">= 0", "vocab_size": f">= {len(SPECIAL_TOKENS) + 256}",
          "hidden_size": ">= 2", "num_layers": ">= 1", "num_heads": ">= 1", "num_kv_heads": ">= 1",
          "intermediate_size": ">= 1", "block_size": ">= 1", "tasks_per_step": ">= 1", "group_size": ">= 1",
          "max_new_tokens": ">= 1", "temperature": ">= 0", "threshold": "[0, 1]", "steps_per_block": ">= 1",
          "rollout_batch": ">= 1", "update_tokens": ">= 0", "updates_per_step": ">= 0", "rows_per_update": ">= 1", "clip_eps": "[0, 1)",
          "dynamic_sampling_rounds": ">= 0", "kl_beta": ">= 0", "eval_every": ">= 0", "verifier_workers": ">= 1",
          "verify_timeout": "> 0", "seed": "[0, 4294967295]"}
ENDLESS = ("grad_clip",)   # inf: no clipping
# whole-number flags whose 0 means auto, resolved where the machine is known: --help shows "auto", the flag takes it
AUTO = ("update_tokens", "grad_accum", "max_len")
# the flags only some phases use (every other flag: every phase but init); init uses INIT_FLAGS alone
PHASE_FLAGS = {
    "init": ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
             "block_size"),
    "sft": ("epochs", "batch_size", "grad_accum", "schedule", "min_lr_ratio", "warmup", "warmup_ratio", "max_len", "sft_infill",
            "sft_pad_targets"),
    "infill/e2e": ("tasks_per_step", "group_size", "max_new_tokens", "temperature", "remasking", "threshold",
                   "steps_per_block", "rollout_batch", "update_tokens", "update_rows", "updates_per_step", "rows_per_update", "minibatch_order",
                   "optimizer_state", "clip_eps", "kl_beta", "reference_model", "reward", "reward_rules", "eval_every",
                   "eval_data", "verifier_workers", "verify_timeout", "prompt_template", "task_order",
                   "dynamic_sampling_rounds")}
INIT_FLAGS = ("phase", "data", "out", "overwrite") + PHASE_FLAGS["init"]

EMBEDDED_MODEL = Path(__file__).resolve().parent / "assets" / "dice-tiny"
# DICE's gradient is 1/32 of ours at the same loss (its 32 accumulation steps divide it twice: DESIGN.md §7),
# so its clip of 1.0 (`max_grad_norm`, DeepSpeed's `gradient_clipping`) is 32 here
RL_GRAD_CLIP = 32.0
# BiC-RL's own (DESIGN.md §7): DICE's AdamW lr, its clip in our units, TraceRL's normalisation
_RL = {"lr": 1e-6, "grad_clip": RL_GRAD_CLIP, "loss_norm": "step"}
# dice-tiny's recipe (its card); a rollout of a quarter of DICE's 64 x 16 samples takes an optimiser
# step per a quarter of DICE's 256 trace rounds, so the ratio and KL act as in DICE; every step holds
# the levels in their shares (--task-order interleaved; with EMBEDDED_RL_TASKS every step holds them all)
_RL_EMBEDDED = {"steps": 6, "tasks_per_step": 32, "group_size": 8, "max_new_tokens": 704, "lr": 1e-4,
                "rows_per_update": 64, "rollout_batch": 256, "update_tokens": 65536, "verify_timeout": 5.0,
                "save_every": 2, "verifier_workers": max(1, min(14, (os.cpu_count() or 4) - 2)),
                "task_order": "interleaved"}
# Every value that differs from its field's dataclass default, and where (tests/test_config.py lists
# them): a phase's row applies to the fields a TrainConfig is not given; "PHASE embedded" is what
# `python train.py --phase PHASE` runs with neither --model nor --data (dice-tiny on EMBEDDED_DATA, short
# enough for a demo), on top of its phase's row, for the flags the command line does not give.
DEFAULTS = {
    "infill": _RL,
    "e2e": _RL,
    "sft embedded": {"steps": 30, "save_every": 10},
    "infill embedded": _RL_EMBEDDED,
    "e2e embedded": _RL_EMBEDDED,
}
# The RL phases' tasks, shipped: 32 tasks (13 level 1, 19 level 3) of the rl split of dice-tiny's
# BiC-RL experiment (its card: `python -m dice.taskgen --valid 300 --heldout 440 --seed 0`, rl.json),
# ids as there, each step all 32 (tasks_per_step): a reward shows learning where the tasks recur and
# their groups disagree. Chosen from rl-split tasks only, on dice-tiny's greedy kernels against the
# references (CPU, float32, 704 tokens, 2026-12-04): 32 of the 141 whose kernel differs from the
# reference only in its numbers (a miscopied constant, which lies in the infill middle too), never
# from held-out or valid results; none is an SFT task (tests/test_embedded_rl_tasks.py)
EMBEDDED_RL_TASKS = EMBEDDED_MODEL / "rl-tasks.json"
# the embedded run's data per phase: (taskgen split, tasks drawn) or a task file
EMBEDDED_DATA = {"sft": ("train", 200), "infill": EMBEDDED_RL_TASKS, "e2e": EMBEDDED_RL_TASKS}


def phase_defaults(phase: str, embedded: bool = False) -> dict:
    """The values `phase` (and with `embedded` its embedded run) gives the fields not given (DEFAULTS)."""
    return DEFAULTS.get(phase, {}) | (DEFAULTS.get(f"{phase} embedded", {}) if embedded else {})


def _group_of(name: str) -> str:
    """The --help group of a field: the phase(s) that use it."""
    if name in ("phase", "data", "out", "overwrite"):
        return "every phase"
    return next((f"--phase {phase}" for phase, names in PHASE_FLAGS.items() if name in names),
                "training (--phase sft, infill, e2e)")


def _shown_default(name: str, phase: str | None) -> str:
    """The default of a field as the phase(s) use it, and the embedded run's value where it sets one:
    "(default: 0; embedded run: 30)", or with no --phase, per phase where they differ."""
    if name in INIT_FLAGS or phase == "init":
        default = getattr(TrainConfig(), name)
        return "" if default is False or default == "" else f" (default: {default})"
    phases = {"sft": "sft", "e2e": "infill/e2e"} if phase is None else {phase: phase}
    used = {label: getattr(TrainConfig(phase=p), name) for p, label in phases.items()}
    embedded = {label: DEFAULTS[f"{p} embedded"][name] for p, label in phases.items()
                if name in DEFAULTS[f"{p} embedded"]}

    def shown(value) -> str:
        if name in AUTO and value == 0:
            return "auto"
        return f"{value:g}".replace("e-0", "e-") if isinstance(value, float) else str(value)   # 1e-5, as README

    def listed(values: dict) -> str:
        if len({shown(v) for v in values.values()}) == 1 and len(values) == len(phases):
            return shown(next(iter(values.values())))
        return ", ".join(f"{label} {shown(v)}" for label, v in values.items())

    text = "" if all(v is False or v == "" for v in used.values()) else f"default: {listed(used)}"
    if embedded:
        text += ("; " if text else "") + f"embedded run (no --model/--data): {listed(embedded)}"
    return f" ({text})" if text else ""


def _listed(group: str, phase: str | None) -> bool:
    """Whether `train.py --phase PHASE --help` lists a flag of this group (every group without --phase)."""
    if phase is None or group == "every phase":
        return True
    if phase == "init":
        return group == "--phase init"
    return group.startswith("training") or group == ("--phase sft" if phase == "sft" else "--phase infill/e2e")


def _parser(with_defaults: bool, phase: str | None = None) -> ArgumentParser:
    """train.py's parser; --help groups the flags by the phases that use them, only `phase`'s groups
    when --phase is given, and shows each default as that phase uses it (`_shown_default`)."""
    parser = ArgumentParser(prog="train.py", description="SFT and BiC-RL training (see README); "
                            "`train.py --phase PHASE --help` lists that phase's flags alone",
                            argument_default=None if with_defaults else argparse.SUPPRESS)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(TrainConfig):
        title = _group_of(f.name)
        helped = HELP[f.name] + _shown_default(f.name, phase) if _listed(title, phase) else argparse.SUPPRESS
        group = groups.setdefault(title, parser.add_argument_group(title))
        flag = "--" + _flag(f.name)
        default = {"default": f.default} if with_defaults else {}
        if f.type in ("bool", bool):
            group.add_argument(flag, action="store_true", help=helped, **default)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            kind = auto_or_count if f.name in AUTO else kind
            group.add_argument(flag, type=kind, choices=CHOICES.get(f.name), help=helped, **default)
    return parser


def auto_or_count(text: str) -> int:
    """An AUTO flag's value: "auto" (0) or a whole number (its range: RANGES)."""
    return 0 if text == "auto" else int(text)


def _phase_asked(argv: list[str] | None) -> str | None:
    """The --phase on the command line, if it is one (for --help, before the parser exists)."""
    args = sys.argv[1:] if argv is None else list(argv)
    values = [b for a, b in zip(args, args[1:]) if a == "--phase"] + [a[8:] for a in args if a.startswith("--phase=")]
    return values[-1] if values and values[-1] in CHOICES["phase"] else None


def config_from_args(argv: list[str] | None = None) -> tuple[TrainConfig, set[str]]:
    """argparse over the TrainConfig fields (`--batch-size 8`, `--resume`, ...): the config, and the
    names of the fields given on the command line. A value no run could mean (`TrainConfig.validate`)
    and a flag the phase does not use are usage errors (exit status 2)."""
    parser = _parser(with_defaults=True, phase=_phase_asked(argv))
    args = parser.parse_args(argv)
    given = set(vars(_parser(with_defaults=False).parse_args(argv)))
    uses = INIT_FLAGS if args.phase == "init" else [f.name for f in dataclasses.fields(TrainConfig) if not any(
        f.name in names for phase, names in PHASE_FLAGS.items() if args.phase not in phase.split("/"))]
    unused = sorted(given - set(uses), key=[f.name for f in dataclasses.fields(TrainConfig)].index)
    if unused:
        phases = next((p for p, names in PHASE_FLAGS.items() if unused[0] in names), "sft, infill, e2e")
        parser.error(f"--{_flag(unused[0])} is a flag of --phase {phases}, which --phase {args.phase} does not "
                     "use; drop it")
    try:   # the fields not given take their phase's default (DEFAULTS), not the parser's
        return TrainConfig(**{name: getattr(args, name) for name in given | {"phase"}}), given
    except ValueError as e:
        parser.error(str(e))


def with_embedded_defaults(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """`cfg` with the embedded run's model and its row of DEFAULTS wherever the command line gave none."""
    recipe = phase_defaults(cfg.phase, embedded=True)
    return dataclasses.replace(cfg, model=str(EMBEDDED_MODEL),
                               **{name: value for name, value in recipe.items() if name not in given})
