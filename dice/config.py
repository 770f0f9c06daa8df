"""The configuration of `python train.py`: one dataclass whose fields are the flags (DESIGN.md §4, §7).

Every field of `TrainConfig` is a `--flag` (`config_from_args`); CHOICES and RANGES bound the values
(`validate`), HELP (`dice.config_help`) is the --help text, grouped by the phases that use a flag
(PHASE_FLAGS: a flag given to a phase that does not use it is an error, not silently ignored).
Defaults that depend on the phase (learning rate, loss normalisation, gradient clip) are filled in
`__post_init__`; those that depend on the machine (SFT batch, row length and micro-batches per step:
0 = auto) in `dice.sft.train_sft`. The defaults are the originals' (DESIGN.md §4, §7): AdamW betas
(0.9, 0.999) and SFT lr 1e-5 constant after warm-up (deadlykitten4/DICE
`training/sft/llama_factory_sdar/examples/train_full_sdar/sdar_*_full.yaml`: `lr_scheduler_type:
constant_with_warmup`), SDAR's per-micro-batch token mean for SFT, TraceRL's per-step L1
normalisation, one optimiser step per 256 round rows, DICE's effective gradient clip and a fresh
AdamW per step for RL (DICE's `training/RL/configs/rl_sdar_kernel_*.yaml`, DESIGN.md §7).

The fields stay flat, one per flag, grouped by comments in --help's order: the parser, CHOICES,
RANGES, HELP, EMBEDDED, RESUME_FIELDS and run.json all name a setting by its flag. What the RL code
needs as one object is built from them: `sampling()` the rollouts' `Sampling`, and
`dice.rl.rewards.rl_rewards` the reward with its verifier.

EMBEDDED is what `python train.py --phase sft|infill|e2e` runs with neither --model nor --data:
the shipped dice-tiny on tasks `dice.taskgen` generates with a fixed seed, short enough for a demo
(minutes); every flag given still wins.
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
from .rl.packing import UPDATE_ROWS
from .sampling.choice import REMASKING, Sampling

# DICE's gradient is 1/32 of ours at the same loss (its 32 accumulation steps divide it twice: DESIGN.md §7),
# so its clip of 1.0 (`max_grad_norm`, DeepSpeed's `gradient_clipping`) is 32 here
RL_GRAD_CLIP = 32.0


@dataclass
class TrainConfig:
    """Flags of `python train.py`: every field is a `--flag`; CHOICES and RANGES below bound their
    values, HELP is their --help text (see also README)."""
    # what runs, on what, into where
    phase: str = "sft"
    model: str = ""
    data: str = ""
    out: str = ""
    # how long, in what batches (SFT; RL's batches are below)
    steps: int = 0
    epochs: float = 0.0
    batch_size: int = 0
    grad_accum: int = 0
    # the optimiser and its schedule (dice.runtime: make_optimizer, lr_at)
    lr: float = 0.0
    schedule: str = "constant"
    min_lr_ratio: float = 0.1
    warmup: int = 0
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 0.0
    # the loss, the row length, the precision
    loss_norm: str = ""
    max_len: int = 0
    dtype: str = "auto"
    # the run folder (dice.runs)
    save_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    overwrite: bool = False
    # the seed, memory, SFT's records and masks
    seed: int = 0
    gradient_checkpointing: bool = False
    sft_infill: bool = False
    sft_pad_targets: bool = False
    attention: str = "auto"
    # --phase init: a from-scratch model folder (tokenizer trained on --data, config, no weights)
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    block_size: int = 4
    # BiC-RL (dice.rl.train_rl); the groups below keep the order of --help
    # the step's tasks and samples
    tasks_per_step: int = 64
    task_order: str = "curriculum"
    dynamic_sampling_rounds: int = 0
    group_size: int = 16
    # rollouts: the sampler (`sampling()`), its response length and batch
    max_new_tokens: int = 4096
    temperature: float = 1.0
    remasking: str = "low_confidence_dynamic"
    threshold: float = 0.9
    steps_per_block: int = 4
    rollout_batch: int = 64
    # the update (dice.rl.packing, policy_loss); update_tokens 0: auto (dice.rl.update_memory)
    update_tokens: int = 0
    update_rows: str = "response"
    updates_per_step: int = 0
    rows_per_update: int = 256
    minibatch_order: str = "contiguous"
    optimizer_state: str = "step"
    clip_eps: float = 0.2
    kl_beta: float = 0.01
    reference_model: bool = False
    # the reward (dice.rl.rewards.rl_rewards)
    reward: str = "correct"
    reward_rules: str = "strict"
    # the greedy evaluation
    eval_every: int = 0
    eval_data: str = ""
    # the kernel verifier behind the reward and the evaluation
    verifier_workers: int = 8
    verify_timeout: float = 15.0
    # the rollouts' prompt
    prompt_template: str = ""

    def __post_init__(self):
        self.validate()
        rl = self.phase in RL_PHASES
        if not self.lr:
            self.lr = 1e-6 if rl else 1e-5
        if not self.grad_clip:
            self.grad_clip = RL_GRAD_CLIP if rl else 1.0
        norms = ("step", "response") if rl else ("batch", "sample")
        self.loss_norm = self.loss_norm or norms[0]
        if self.loss_norm not in norms:
            raise UsageError(f"--loss-norm for --phase {self.phase} must be one of {', '.join(norms)}, "
                             f"not {self.loss_norm!r}")

    def sampling(self) -> Sampling:
        """The RL rollouts' sampler settings (--steps-per-block, --remasking, --threshold, --temperature)."""
        return Sampling(steps_per_block=self.steps_per_block, remasking=self.remasking, threshold=self.threshold,
                        temperature=self.temperature)

    def validate(self) -> None:
        """Every value a run could not mean is a UsageError naming its flag: choices, RANGES, finite
        floats, a model shape whose heads do not divide (--phase init), greedy RL rollouts."""
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise UsageError(f"--{_flag(name)} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        for name, rule in RANGES.items():
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value) and not (name in ENDLESS and value == math.inf):
                raise UsageError(f"--{_flag(name)} must be a finite number, got {value}")
            if not _within(value, rule):
                raise UsageError(f"--{_flag(name)} must be {'in ' * (rule[0] in '[(')}{rule}, got {value}")
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
           "task_order": ("curriculum", "interleaved")}
# the range of every number flag (`_within`); every float must be finite but those of ENDLESS
RANGES = {"steps": ">= 0", "epochs": ">= 0", "batch_size": ">= 0", "grad_accum": ">= 0", "lr": ">= 0",
          "min_lr_ratio": "[0, 1]", "warmup": ">= 0", "warmup_ratio": "[0, 1]", "weight_decay": ">= 0",
          "adam_beta1": "[0, 1)", "adam_beta2": "[0, 1)", "grad_clip": ">= 0", "max_len": ">= 0",
          "save_every": ">= 0", "keep_checkpoints": ">= 0", "vocab_size": f">= {len(SPECIAL_TOKENS) + 256}",
          "hidden_size": ">= 2", "num_layers": ">= 1", "num_heads": ">= 1", "num_kv_heads": ">= 1",
          "intermediate_size": ">= 1", "block_size": ">= 1", "tasks_per_step": ">= 1", "group_size": ">= 1",
          "max_new_tokens": ">= 1", "temperature": ">= 0", "threshold": "[0, 1]", "steps_per_block": ">= 1",
          "rollout_batch": ">= 1", "update_tokens": ">= 0", "updates_per_step": ">= 0", "rows_per_update": ">= 1", "clip_eps": "[0, 1)",
          "dynamic_sampling_rounds": ">= 0", "kl_beta": ">= 0", "eval_every": ">= 0", "verifier_workers": ">= 1",
          "verify_timeout": "> 0", "seed": "[0, 4294967295]"}
ENDLESS = ("grad_clip",)   # inf: no clipping
AUTO = ("update_tokens",)   # whole-number flags whose 0 means auto: --help shows "auto", the flag takes it
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
# dice-tiny's recipe (its card); a rollout of a quarter of DICE's 64 x 16 samples takes an optimiser
# step per a quarter of DICE's 256 trace rounds, so the ratio and KL act as in DICE; every step holds
# the levels in their shares (--task-order interleaved; with EMBEDDED_RL_TASKS every step holds them all)
_RL_DEMO = {"steps": 6, "tasks_per_step": 32, "group_size": 8, "max_new_tokens": 704, "lr": 1e-4,
            "rows_per_update": 64, "rollout_batch": 256, "update_tokens": 65536, "verify_timeout": 5.0, "save_every": 2,
            "verifier_workers": max(1, min(14, (os.cpu_count() or 4) - 2)), "task_order": "interleaved"}
# The RL phases' tasks, shipped: 32 tasks (13 level 1, 19 level 3) of the rl split of dice-tiny's
# BiC-RL experiment (its card: `python -m dice.taskgen --valid 300 --heldout 440 --seed 0`, rl.json),
# ids as there, each step all 32 (tasks_per_step): a reward shows learning where the tasks recur and
# their groups disagree. Chosen from rl-split tasks only, on dice-tiny's greedy kernels against the
# references (CPU, float32, 704 tokens, 2026-12-04): 32 of the 141 whose kernel differs from the
# reference only in its numbers (a miscopied constant, which lies in the infill middle too), never
# from held-out or valid results; none is an SFT task (tests/test_embedded_rl_tasks.py)
EMBEDDED_RL_TASKS = EMBEDDED_MODEL / "rl-tasks.json"
# per phase: the flags' values, then (taskgen split, tasks drawn) or a task file; dice-tiny's card has its recipe
EMBEDDED = {"sft": ({"steps": 30, "save_every": 10}, ("train", 200)),
            "infill": (_RL_DEMO, EMBEDDED_RL_TASKS), "e2e": (_RL_DEMO, EMBEDDED_RL_TASKS)}


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
    embedded = {label: EMBEDDED[p][0][name] for p, label in phases.items() if name in EMBEDDED[p][0]}

    def shown(value) -> str:
        if name in AUTO and value == 0:
            return "auto"
        return f"{value:g}" if isinstance(value, float) else str(value)

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
    try:
        return TrainConfig(**vars(args)), given
    except ValueError as e:
        parser.error(str(e))


def with_embedded_defaults(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """`cfg` with the embedded default's model and flags (EMBEDDED) wherever the command line gave none."""
    flags, _ = EMBEDDED[cfg.phase]
    return dataclasses.replace(cfg, model=str(EMBEDDED_MODEL),
                               **{name: value for name, value in flags.items() if name not in given})
