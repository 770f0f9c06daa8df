"""What every training phase shares: devices and FSDP2, the optimiser and its schedule,
checkpoints that are written atomically and resumed exactly, metrics and the progress line;
and the SFT loop itself (DESIGN.md §4).

Run directory layout (`--out DIR`):
    DIR/metrics.jsonl                 one JSON object per optimiser step
    DIR/checkpoints/step_000100/      a model folder (config.json, safetensors, tokenizer files)
                                      plus trainer_state.pt (optimiser, step); written to a
                                      temporary folder first and renamed, so a kill never leaves
                                      a half-written checkpoint
    DIR/checkpoints/latest            the name of the newest complete checkpoint
    DIR/final/                        the model folder after the last step
A run without --resume refuses an --out that already holds checkpoints.
Randomness is a function of (seed, step, global row), never of a running generator, so a run
resumed from step k continues exactly as the unbroken run would, on any number of processes.
"""
from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import CheckpointError, from_published, has_weights, load_model, read_config, save_model
from .cli import ArgumentParser
from .data import RowStream, collate, read_records, record_texts, tokenize_records
from .diffusion import count_samples, diffusion_loss
from .model import SDAR, ModelConfig
from .rollout import one_shot_style
from .sampler import REMASKING
from .tokenizer import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


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


# ---------------------------------------------------------------- devices and processes

@dataclass
class Runtime:
    device: torch.device
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def autocast(self, dtype: str):
        enabled = dtype == "bf16" or (dtype == "auto" and self.device.type == "cuda")
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def all_sum(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item())

    def all_max(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def setup_runtime() -> Runtime:
    """One process per device under torchrun (NCCL on GPUs, gloo on CPU); plain otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Runtime(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    atexit.register(_shut_down_process_group)
    return Runtime(device, dist.get_rank(), world)


def _shut_down_process_group() -> None:
    """At exit, while the interpreter is whole: free the FSDP modules' reference cycles (they hold
    the process group) and destroy the group. Left to interpreter teardown, the group's threads
    were destroyed unjoined and a finished run aborted (SIGABRT) in about half of loaded runs."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def build_model(cfg: TrainConfig, rt: Runtime, log) -> SDAR:
    """Load `--model`, or initialise it from its config.json when the folder has no weights.
    Parameters stay float32 (the optimiser's master copy); bf16 comes from autocast. With
    several processes every decoder layer and the root are sharded with FSDP2."""
    if has_weights(cfg.model):
        model = load_model(cfg.model, device=rt.device, dtype=torch.float32)
    else:
        log(f"{cfg.model} has config.json but no weights: starting from scratch (random init, seed {cfg.seed})")
        model = SDAR(read_config(cfg.model)).init_weights(seed=cfg.seed).to(rt.device)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    if rt.world > 1:
        shard(model)
    return model.train()


def shard(model: SDAR) -> SDAR:
    """FSDP2 over the process group: every decoder layer is one unit (its parameters are gathered
    just before it runs and freed after), the embedding, final norm and lm_head the root unit."""
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    fused = decay[0].device.type == "cuda"
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), fused=fused)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to min_lr_ratio * lr at `total`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def row_generator(seed: int, step: int, row: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_003 + row)


# ---------------------------------------------------------------- checkpoints and logs

def full_state_dicts(model, optimizer):
    """Full (unsharded, CPU) model and optimiser state dicts, keyed by parameter names, so that
    checkpoints load on any number of processes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint(out: Path, step: int, model, optimizer, tokenizer_dir: str, rt: Runtime,
                    keep: int, extra: dict | None = None) -> None:
    """checkpoints/step_N written as a temporary folder, then renamed; then `latest` updated and
    all but the `keep` newest checkpoints (by step number, never step_N itself) deleted. An
    existing step_N (left by a run killed before `latest` named it) is moved aside, not deleted,
    until the new one is in place."""
    model_state, optim_state = full_state_dicts(model, optimizer)
    if rt.main:
        ckpts = out / "checkpoints"
        final, tmp, aside = (ckpts / name for name in (f"step_{step:06d}", f".step_{step:06d}.tmp",
                                                       f".step_{step:06d}.old"))
        shutil.rmtree(tmp, ignore_errors=True)
        write_model_folder(model, tmp, tokenizer_dir, state_dict=model_state)
        torch.save({"step": step, "optimizer": optim_state, **(extra or {})}, tmp / "trainer_state.pt")
        shutil.rmtree(aside, ignore_errors=True)
        if final.exists():
            os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
        (ckpts / ".latest.tmp").write_text(final.name)
        os.replace(ckpts / ".latest.tmp", ckpts / "latest")
        if keep > 0:
            older = [path for _, path in checkpoint_folders(ckpts) if path != final]
            for path in older[:max(len(older) - (keep - 1), 0)]:
                shutil.rmtree(path, ignore_errors=True)
    rt.barrier()


def checkpoint_folders(ckpts: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoints/step_N folder, in ascending step order."""
    found = [(int(match.group(1)), path) for path in ckpts.glob("step_*")
             if (match := re.fullmatch(r"step_(\d+)", path.name))]
    return sorted(found)


def refuse_to_mix_runs(out: Path, resuming: bool) -> None:
    """A run without --resume must not start in an --out holding checkpoints: its own would be
    pruned and named by `latest` among the earlier run's, and a later --resume could pick either."""
    ckpts = out / "checkpoints"
    if not resuming and ((ckpts / "latest").exists() or checkpoint_folders(ckpts)):
        raise CheckpointError(f"{ckpts} holds checkpoints of an earlier run; pass --resume to continue it "
                              "or choose another --out")


def write_model_folder(model, path: Path, tokenizer_dir: str, state_dict: dict | None = None) -> None:
    """A loadable model folder: config + weights + the tokenizer files of the source folder."""
    save_model(model, path, state_dict=state_dict)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file() and Path(tokenizer_dir).resolve() != path.resolve():
            shutil.copy2(Path(tokenizer_dir) / name, path / name)


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint `latest` names; None without `latest`. One it names that is missing or
    incomplete is an error, not a silent restart at step 0."""
    pointer = out / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = out / "checkpoints" / name
    if not (path / "trainer_state.pt").is_file():
        raise CheckpointError(f"{pointer} names {name}, which is missing or incomplete; write the name of a "
                              "complete step_* folder there to resume from it, or choose another --out")
    return path


def resume(out: Path, model, optimizer, log) -> tuple[int, dict]:
    """Load the newest checkpoint into model and optimiser; returns (next step, trainer state)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    from safetensors.torch import load_file
    path = latest_checkpoint(out)
    if path is None:
        log(f"--resume: no checkpoint in {out / 'checkpoints'}; starting at step 0")
        return 0, {}
    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(f))
    weights = from_published(weights)
    if model.config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    log(f"resumed from {path} (next step {state['step']})")
    return state["step"], state


class MetricsLog:
    """DIR/metrics.jsonl, truncated to the resumed step so a resumed run has no duplicate steps."""

    def __init__(self, out: Path, start_step: int, enabled: bool):
        self.file, self.enabled = out / "metrics.jsonl", enabled
        if enabled and self.file.exists():
            kept = [l for l in self.file.read_text().splitlines() if l.strip() and json.loads(l)["step"] <= start_step]
            self.file.write_text("".join(l + "\n" for l in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.file.open("a") as f:
                f.write(json.dumps(record) + "\n")


def progress_line(step: int, total: int, started: float, first_step: int, fields: dict) -> str:
    done = step + 1 - first_step
    eta = (time.perf_counter() - started) / max(done, 1) * (total - step - 1)
    shown = " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
    return f"step {step + 1}/{total} | {shown} | ETA {int(eta // 60)}m{int(eta % 60):02d}s"


def make_logger(rt: Runtime):
    def log(msg: str) -> None:
        if rt.main:
            print(msg, file=sys.stderr, flush=True)
    return log


# ---------------------------------------------------------------- SFT

def train_sft(cfg: TrainConfig) -> Path:
    """Masked block-diffusion SFT (DESIGN.md §4); returns the final model folder."""
    rt = setup_runtime()
    log = make_logger(rt)
    out = Path(cfg.out)
    refuse_to_mix_runs(out, cfg.resume)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(cfg.model)
    model = build_model(cfg, rt, log)
    bs = model.config.block_size
    row_len = cfg.max_len - cfg.max_len % bs
    examples, skipped = tokenize_records(read_records(cfg.data), tok, row_len, source=cfg.data,
                                         one_shot=one_shot_style(model), infill_copies=cfg.sft_infill)
    if skipped:
        log(f"skipped {skipped} examples longer than --max-len {cfg.max_len} (prompt + response)")
    stream = RowStream(examples, row_len, bs, tok.pad_token_id, cfg.seed)
    rows_per_step = cfg.batch_size * cfg.grad_accum * rt.world
    total = cfg.steps or math.ceil(max(cfg.epochs, 1e-9) * stream.epoch_length(0) / rows_per_step)
    optimizer = make_optimizer(model, cfg)
    start = resume(out, model, optimizer, log)[0] if cfg.resume else 0
    metrics = MetricsLog(out, start, rt.main)
    mask_id = model.config.mask_token_id
    log(f"SFT: {len(examples)} examples, {stream.epoch_length(0)} rows of {row_len} tokens per epoch, "
        f"{rows_per_step} rows per step, steps {start}..{total}, device {rt.device} x{rt.world}")
    use_flex = cfg.attention == "flex" or (cfg.attention == "auto" and rt.device.type == "cuda")
    started = time.perf_counter()
    for step in range(start, total):
        t0 = time.perf_counter()
        lr = lr_at(step, total, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_rows = stream.rows(step * rows_per_step, rows_per_step)
        global_samples = sum(count_samples(r["loss_mask"][None], r["sample_ids"][None]) for r in step_rows)
        loss_sum, tokens = 0.0, 0
        for micro in range(cfg.grad_accum):
            first = (micro * rt.world + rt.rank) * cfg.batch_size
            rows = step_rows[first:first + cfg.batch_size]
            gens = [row_generator(cfg.seed, step, step * rows_per_step + first + i) for i in range(len(rows))]
            with rt.autocast(cfg.dtype):
                loss = diffusion_loss(model, collate(rows), gens, mask_id, use_flex=use_flex)
            # FSDP averages gradients over processes: scale so the step's gradient is the mean
            # over the global batch's samples
            (loss * rt.world / global_samples).backward()
            loss_sum += loss.item()
            tokens += sum(int((r["sample_ids"] >= 0).sum()) for r in rows)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = rt.all_sum(loss_sum) / global_samples
        tokens = int(rt.all_sum(tokens))
        dt = time.perf_counter() - t0
        record = {"step": step + 1, "loss": loss_value, "lr": lr, "tokens_per_s": tokens / dt,
                  "grad_norm": float(grad_norm), "step_time_s": dt}
        metrics.write(record)
        log(progress_line(step, total, started, start, {"loss": loss_value, "lr": lr,
                                                        "tok/s": round(tokens / dt)}))
        if cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == total):
            save_checkpoint(out, step + 1, model, optimizer, cfg.model, rt, cfg.keep_checkpoints)
    return save_final(model, optimizer, out, cfg.model, rt, log)


def save_final(model, optimizer, out: Path, tokenizer_dir: str, rt: Runtime, log) -> Path:
    """DIR/final: the trained model folder, written once (by rank 0) from the full state."""
    state, _ = full_state_dicts(model, optimizer)
    if rt.main:
        write_model_folder(model, out / "final", tokenizer_dir, state_dict=state)
        log(f"wrote {out / 'final'}")
    rt.barrier()
    return out / "final"


def init_model_folder(cfg: TrainConfig) -> Path:
    """`--phase init`: train a byte-level BPE on the prompts and responses of --data and write a
    model folder with it and a config.json (no weights: SFT then starts from scratch). Prompts
    carry no one-shot example (`dice_one_shot: null`), which keeps them short for small models."""
    from .tokenizer import train_tokenizer
    out = Path(cfg.out)
    texts = ["".join(record_texts(r, f"{cfg.data}: record {i}", one_shot=None)[0])
             for i, r in enumerate(read_records(cfg.data))]
    tok = train_tokenizer(texts, cfg.vocab_size, out)
    config = ModelConfig(
        vocab_size=tok.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, mask_token_id=tok.mask_token_id, block_size=cfg.block_size,
        tie_word_embeddings=True, max_position_embeddings=8192,
        extra={"dice_one_shot": None, "eos_token_id": tok.im_end_id, "pad_token_id": tok.pad_token_id})
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    print(f"wrote {out}: tokenizer of {tok.vocab_size} tokens trained on {len(texts)} records, config with "
          f"{config.num_parameters() / 1e6:.2f}M parameters (no weights)", file=sys.stderr)
    return out


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
