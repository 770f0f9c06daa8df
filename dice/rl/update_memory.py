"""The RL update's micro-batch budget, planned from the GPU memory free when the update starts
(DESIGN.md §7), as `dice.rl.rollout.auto_rollout_batch` sizes the rollout batch.

`--update-tokens` 0 (auto, the default) asks at the start of every update, and of the old log-probs'
pass beside the reward's tail that shares its micro-batches' shape (`dice.rl.update.OldLogprobs`),
what this process can take on the GPU (`dice.memory.gpu_memory`: by then the rollouts' KV caches are freed into
its allocator, and the float32 weights and the old log-probs are allocated). The plan
(`dice.memory.plan_update_tokens`) sets aside what the update will allocate and has not yet: every
parameter's gradient where it is None (4 bytes a float32 parameter: each optimiser step sets them to
None), AdamW's two moments where the optimiser holds no state for it (8 bytes: `--optimizer-state
step` drops them after every update, `restart_moments`, and the first optimiser step makes them
again), the bf16 weight copies and a gradient's casts (`dice.memory.update_fixed_bytes`), and what
the verifier's processes do not hold yet; the rest, `dice.memory.update_token_bytes` a token, is the
budget. The plan counts FlexAttention's masks (CUDA's default); `--attention dense` on a GPU adds
[rows, L, L] masks it does not count. On a CPU there is no device memory to plan: UPDATE_TOKENS_CPU.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..memory import (FLEX_TILE, GIB, UPDATE_TOKENS_CPU, MemoryShortage, gpu_memory, plan_update_tokens,
                      update_fixed_bytes, update_token_bytes)
from ..model.packing import group_bound, largest_group

CHECKPOINTING = "turn on gradient checkpointing (train.py --gradient-checkpointing, bench rl --grad-ckpt)"


def unallocated_state_bytes(model, optimizer) -> int:
    """The bytes of the gradients and AdamW moments the update will allocate and has not: a
    parameter's own size (this process's shard under FSDP2) for a gradient that is None, twice it
    for moments the optimiser does not hold (optimizer None: none held)."""
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p   # an FSDP2 DTensor: this process's shard
        size = local.numel() * local.element_size()
        total += size * ((p.grad is None) + 2 * (optimizer is None or not optimizer.state.get(p)))
    return total


def auto_update_tokens(model, cfg, others_bytes: int = 0, optimizer=None, longest: int = 0, processes: int = 1) -> int:
    """The largest update micro-batch budget (tokens) that fits on the GPU now (module docstring,
    `dice.memory.plan_update_tokens`): a whole number of FlexAttention tiles (and of blocks), at most
    UPDATE_TOKENS_MAX and never below `longest`, the largest group of rounds the step packs
    (`dice.model.packing.largest_group`). others_bytes: what the verifier's processes hold once they
    have verified a while (`Verifier.gpu_bytes`); the part not in use yet is set aside. Where not
    even that group fits, a MemoryShortage naming gradient checkpointing and --max-new-tokens.
    On a CPU: UPDATE_TOKENS_CPU."""
    first = next(model.parameters())
    if first.device.type != "cuda":
        return UPDATE_TOKENS_CPU
    config = model.config
    autocast = cfg.dtype in ("auto", "bf16")   # `Runtime.autocast` on CUDA
    per_token = update_token_bytes(config, cfg.gradient_checkpointing, 2 if autocast else first.element_size())
    # autocast copies float32 weights (the RL master weights); weights already bf16 are used as they are
    fixed = update_fixed_bytes(config, autocast and first.dtype == torch.float32, processes)
    fixed += unallocated_state_bytes(model, optimizer)
    available, in_use = gpu_memory(first.device)
    unheld = max(0, others_bytes - in_use)
    granule = math.lcm(config.block_size, FLEX_TILE)
    tokens = plan_update_tokens(available, unheld, fixed, per_token, longest, granule)
    if tokens:
        return tokens
    fix = "lower --max-new-tokens" + ("" if cfg.gradient_checkpointing else f" or {CHECKPOINTING}")
    raise MemoryShortage(f"the RL update cannot hold a micro-batch of its longest response ({longest} tokens: the "
                         f"clean stream and one noisy copy, {longest * per_token / GIB:.1f} GiB) in the "
                         f"{available / GIB:.1f} GiB this process can take on {first.device}, less "
                         f"{fixed / GIB:.1f} GiB of gradients, AdamW moments and bf16 weight copies still to come"
                         + (f" and {unheld / GIB:.1f} GiB the verifier's processes do not hold yet" if unheld else "")
                         + f"; {fix}")


class UpdateTokens:
    """An RL run's update micro-batch budget, asked with the step's config at the start of every update
    (`dice.rl.update.policy_update`; the old log-probs' pass, which shares the micro-batches' shape: `for_forwards`):
    `--update-tokens` as given, or auto (`auto_update_tokens`, for the largest group of the step's
    completions), keeping the last budget while it still fits and holds that group, so that compiled
    FlexAttention meets one shape a run and compiles again only where the memory shrank. Under
    torchrun every process calls it alike and all take the smallest. others(): the bytes of the
    verifier's processes (`Verifier.gpu_bytes`); optimizer None: no moments held."""

    def __init__(self, model, optimizer, rt, others: Callable[[], int] | None = None):
        self.model, self.optimizer, self.rt, self.others = model, optimizer, rt, others
        self.last = 0

    def __call__(self, cfg, completions) -> int:
        """The budget for an update over `completions` (their largest group, `largest_group`)."""
        return self.plan(cfg, largest_group(completions, cfg.update_rows, self.model.config.block_size))

    def for_forwards(self, cfg, completions) -> int:
        """The budget of no-grad forwards over `completions` (the old log-probs, beside the reward's
        tail, the rollouts' bf16 weights still held): the last one planned while it holds their
        largest group, so that they meet the update's shape; such a micro-batch keeps no activations
        and the plan set aside gradients and moments not made yet, so it fits where the update's
        does. None planned yet, or a larger group: a plan now."""
        if cfg.update_tokens:
            return cfg.update_tokens
        if self.last >= largest_group(completions, cfg.update_rows, self.model.config.block_size):
            return self.last
        return self(cfg, completions)

    def before_rollouts(self, cfg, prompt_len: int = 0, response_len: int = 0) -> int:
        """The budget for the longest response a step can bring (`response_len`, or --max-new-tokens,
        after a prompt of `prompt_len`), planned before the first rollout: what no step could hold is
        refused then, not after minutes of rollouts."""
        bs = self.model.config.block_size
        length = -(-(prompt_len + (response_len or cfg.max_new_tokens)) // bs) * bs
        return self.plan(cfg, group_bound(prompt_len, length, bs, cfg.update_rows))

    def plan(self, cfg, longest: int) -> int:
        """The budget for groups of up to `longest` tokens."""
        if cfg.update_tokens:
            return cfg.update_tokens
        # asked on a GPU alone: a reward's stand-in on the CPU (tests) need not know the verifier's memory
        cuda = next(self.model.parameters()).device.type == "cuda"
        shortage, tokens = None, 0
        try:
            tokens = auto_update_tokens(self.model, cfg, self.others() if self.others and cuda else 0,
                                        self.optimizer, longest, self.rt.world)
        except MemoryShortage as e:   # said once every process has heard: a process alone must not stop
            shortage = e
        tokens = int(-self.rt.all_max(-tokens))
        if not tokens:
            raise shortage or MemoryShortage("the RL update does not fit another process's GPU (its line above)")
        self.last = self.last if longest <= self.last <= tokens else tokens
        return self.last
