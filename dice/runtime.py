"""What every training phase shares: the processes and devices it trains on (torchrun, FSDP2; each
process's share of the verifier, `rank_verifier`), the model on them, the optimiser and its
schedule, and the rows' random streams; a run's folder (checkpoints, resume, metrics) is
`dice.run_folder`.

Randomness is a function of (seed, step, global row), never of a running generator, so a run
resumed from step k continues exactly as the unbroken run would; where the process count shapes a
step (SFT's micro-batches per step, RL's optimiser steps over each process's rows) run.json keeps
it and a resume on another count is refused.
"""
from __future__ import annotations

import atexit
import gc
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import TrainConfig
from .model.checkpoint import has_weights, load_model, read_config
from .model.sdar import SDAR


@dataclass
class Runtime:
    device: torch.device
    rank: int = 0
    world: int = 1
    sharded: bool = False   # FSDP2 holds the model: several processes, or `--offload cpu` on one

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


def setup_runtime(offload: bool = False) -> Runtime:
    """One process per device under torchrun (NCCL on GPUs, gloo on CPU); plain otherwise, but with
    `offload` (FSDP2's CPU offload, which needs a process group) a group of this one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not offload:
        return Runtime(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    elif not dist.is_initialized():   # one process: an in-memory rendezvous (an earlier run of this process may have made it)
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(_shut_down_process_group)
    return Runtime(device, dist.get_rank(), world, sharded=True)


def _shut_down_process_group() -> None:
    """At exit, while the interpreter is whole: free the FSDP modules' reference cycles (they hold
    the process group) and destroy the group. Left to interpreter teardown, the group's threads
    were destroyed unjoined and a finished run aborted (SIGABRT) in about half of loaded runs."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_verifier(workers: int, device: torch.device) -> dict:
    """This process's Verifier arguments: its own GPU (under torchrun rank r trains on cuda:r, and its
    rollouts' kernels run there too) and its share of `--verifier-workers`, which counts the
    workers of the whole host (LOCAL_WORLD_SIZE processes share its cores)."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return {"workers": max(1, workers // local), "device": str(device) if device.type == "cuda" else "cuda"}


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
    if rt.sharded:
        shard(model, rt.device, offload=cfg.offload == "cpu")
        log(f"FSDP2 over {rt.world} process{'es' * (rt.world > 1)}"
            + (f"; the float32 weights, gradients and AdamW moments in host memory, copied to {rt.device} as "
               "each layer runs (--offload cpu)" if cfg.offload == "cpu" else ""))
    return model.train()


def shard(model: SDAR, device: torch.device | None = None, offload: bool = False) -> SDAR:
    """FSDP2 over the process group: every decoder layer is one unit (its parameters are gathered
    just before it runs and freed after), the embedding, final norm and lm_head the root unit.
    offload: FSDP2's CPUOffloadPolicy: the float32 parameters, their gradients and so the AdamW
    moments live in host memory (pinned on CUDA), each unit copied to `device` as it runs, and the
    optimiser steps on the CPU (the 4B's 65.7 GiB of training state beside the rollouts on an 80 GB
    GPU, issue #64); `model.compute_device` then names `device` (`dice.model.sdar.compute_device`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard   # lazy: ~1.5 s of start-up
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=policy)
    if offload:
        model.compute_device = device
    return fully_shard(model, offload_policy=policy)


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    fused = decay[0].device.type == "cuda"
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), fused=fused)


def warmup_steps(total: int, cfg: TrainConfig) -> int:
    """`--warmup` steps, or with 0 ceil(--warmup-ratio x total) (Hugging Face
    `TrainingArguments.get_warmup_steps`; DICE's SFT: `warmup_ratio: 0.03`)."""
    return cfg.warmup or math.ceil(total * cfg.warmup_ratio)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """lr x step / w over the w = `warmup_steps` first steps (0-based), so the first step's lr is 0,
    as in Hugging Face's schedules (transformers `optimization.py`,
    `_get_constant_schedule_with_warmup_lr_lambda`), then `constant` (DICE's LLaMA-Factory
    `constant_with_warmup`) or `cosine` decay to min_lr_ratio * lr at `total`."""
    warmup = warmup_steps(total, cfg)
    if step < warmup:
        return cfg.lr * step / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    frac = (step - warmup) / max(1, total - warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def row_generator(seed: int, step: int, row: int) -> torch.Generator:
    # folded into torch's 64-bit seed range (large seeds overflowed it); smaller values are unchanged
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_000_003 + row) % 2 ** 63)
