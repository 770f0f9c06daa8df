"""The update side of a BiC-RL step (DESIGN.md §7), read top to bottom in the order it runs: the
trace rounds of each kept response, the plan of optimiser steps and micro-batches, the old
log-probs (computed beside the reward's tail), the loss and the optimiser steps (`policy_update`).

Trace -> training rounds (`trace_rounds`): the sampler's step map says when every response token
was unmasked. For each block (on the absolute grid, the prompt's tail included) the distinct
step values s_1 < s_2 < ... are its rounds; round r replays the state the sampler saw at that
block's r-th step: tokens unmasked at step >= s_r are MASK, earlier ones clean, and the loss
counts the tokens unmasked at s_r. Blocks never see each other's noisy copies, so round r of
every block shares one round row: a response has max_b(#rounds) rows (`dice.model.packing` lays them
out beside one clean stream, in micro-batches of `--update-tokens`). The sampler denoises whole
blocks and then cuts the response, so the last block's positions after the cut (the completion's
tail) were context at each of that block's steps: they join the replay in the same MASK-or-clean
state, but never the loss, and a step that unmasked only tail positions is not a round.

The plan (`update_plan`): the round rows, response by response, cut into U optimiser steps
(`minibatches`: DICE's consecutive chunks of the rows in rollout order, `--minibatch-order
contiguous`, or the same cut after a seeded shuffle), each step's rows weighted (`row_weights`)
and packed into micro-batches. DICE takes one optimiser step per 256 round rows
(`total_batch_size_lm` = batch_size_lm 1 x 8 GPUs x 32 accumulation steps, one epoch;
`training/RL/configs/rl_sdar_kernel_*.yaml`): `--updates-per-step 0` (default) does the same with
`--rows-per-update 256`, the ratio always against the rollout policy's log-probs from before the
first, so after the first optimiser step clipping and KL act.

Old log-probs (`OldLogprobs`): with U > 1 the update starts with a no-grad pass over all its
micro-batches, about a quarter of its time. Those log-probs depend only on the responses and on the
weights, both fixed once the last token is generated, while the reward's tail (the builds and
verdicts of the last rollouts) leaves the GPU all but idle: the pass runs there, over every response
in micro-batches of its own, until the reward is in; the update takes a micro-batch's old log-probs
from it where all its rounds were computed and runs its own pass for the others. A loss token's
log-prob does not depend on the micro-batch that holds it (samples never attend to each other), so
both passes agree to rounding: to ~1e-6 in float32, and under bf16 autocast to the last bits of the
logits, against the ratio's clip of +-0.2.

Objective per loss token (ids kept from generation, never re-tokenised; `policy_loss`):
    rho = exp(logp_new - logp_old)
    l   = -min(rho A, clip(rho, 1 - eps, 1 + eps) A) + beta * k3,   k3 = e^(lr - ln) - (lr - ln) - 1
with lr the reference log-prob (a frozen reference model, or the rollout policy), ln = logp_new.
Normalisation (`--loss-norm`): `step` (default; TraceRL's Gen-Verse/dLLM-RL `train/rl_sdar.py`, as
in deadlykitten4/DICE `training/RL/train/rl_sdar.py`: `surrogate_tok.sum(dim=1) / L1`, then
`sum() / B` over the round rows) makes an optimiser step's loss the mean over its round rows of
(the row's token terms summed) / L1, L1 the longest kept response of the RL step, so every loss
token weighs the same; `response` divides each response by its own length and averages over
responses (GRPO-style: 100 tokens weigh as much as 1,000). The gradient is clipped to 32 by
default, DICE's clip of 1.0 in these units (its gradient is 1/32 of this one), and AdamW's moments
restart every RL step as in DICE (`--optimizer-state step`, `restart_moments`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import torch

from ..memory import CHECKPOINTING, UpdateTokens
from ..refusals import out_of_memory
from ..model.packing import (CompileClock, PackedBatch, Round, empty_batch, flex_length, group_rounds, micro_batches,
                             pack, pad_batch, packed_logprobs, update_flops, uses_flex)
from ..model.sdar import compute_device
from ..sampling.completion import Completion


# ---------------------------------------------------------------- trace rounds

def trace_rounds(step_map: Sequence[int], prompt_len: int, block_size: int,
                 tail_step_map: Sequence[int] = ()) -> list[Round]:
    """Training rounds of one rollout (module docstring); positions index prompt + response + tail.

    A block's rounds are the distinct steps s_r of its response tokens; round r masks the block's
    positions, tail included, with step >= s_r and counts the response tokens with step == s_r.
    Vectorised (a DICE step replays ~2M tokens): the thresholds s_r of every block in one
    [blocks, rounds] table, filled from the sorted distinct (block, step) pairs of the response."""
    if not step_map:
        return []
    steps = torch.tensor([*step_map, *tail_step_map], dtype=torch.long)
    pos = prompt_len + torch.arange(len(steps))
    block = pos // block_size - prompt_len // block_size
    span = int(steps.max()) + 2        # (block, step) -> one sortable key
    key = block[:len(step_map)] * span + steps[:len(step_map)]
    pairs = torch.unique(key)          # sorted: by block, then by step
    pair_block, pair_step = pairs // span, pairs % span
    rank = torch.arange(len(pairs)) - torch.searchsorted(pair_block, pair_block)   # r of s_r within its block
    threshold = torch.full((int(block[-1]) + 1, int(rank.max()) + 1), span)        # span: no such round
    threshold[pair_block, rank] = pair_step
    masked = steps[:, None] >= threshold[block]                                    # [positions, rounds]
    loss_round = rank[torch.searchsorted(pairs, key)]
    response_pos = pos[:len(step_map)]
    return [Round(pos[masked[:, r]].tolist(), response_pos[loss_round == r].tolist(), r)
            for r in range(threshold.shape[1])]


def row_weights(items: list[tuple[int, Completion, Round]], norm: str, *, width: int, rows: int, responses: int,
                updates: int) -> list[float]:
    """The weight of every loss token of each row (module docstring): `step`, 1 / (width * rows), with
    `rows` the round rows of the whole optimiser step (all processes) and `width` the step's L1;
    `response`, updates / (its response's length * responses), so each of the `updates` minibatches
    (every updates-th row) is a full-batch step. The tail is not part of the response: no weight
    in its length."""
    if norm == "step":
        return [1.0 / (width * rows)] * len(items)
    return [updates / (len(c.tokens) * responses) for _, c, _ in items]


# ---------------------------------------------------------------- the plan

def minibatches(items: list, updates: int, order: str = "contiguous", seed: int = 0) -> list[list]:
    """The round rows of each of a step's `updates` optimiser steps (DESIGN.md §7).

    `items` come in rollout order: response by response, each response's rounds in order. contiguous
    (DICE): they are cut into `updates` consecutive runs whose sizes differ by at most one, so a
    step trains every round of a few responses, as DICE's 256-row chunks do (`train/rl_sdar.py`: a
    DataLoader without a sampler over rows built response by response, one optimiser step per 32
    accumulation steps of 8 processes); DICE drops the last N mod 256 rows' gradient (no step
    follows them), here every row trains. shuffle: the same cut after a permutation seeded by
    `seed`, so every step mixes responses and rounds of the whole rollout."""
    if order == "shuffle":
        items = [items[i] for i in torch.randperm(len(items), generator=torch.Generator().manual_seed(seed))]
    base, extra = divmod(len(items), updates)
    bounds = [u * base + min(u, extra) for u in range(updates + 1)]
    return [items[bounds[u]:bounds[u + 1]] for u in range(updates)]


def round_items(completions, ks, block_size: int, offset: int = 0) -> list[tuple[int, Completion, Round]]:
    """(offset + k, completion k, round) for every trace round of the responses `ks`, response by
    response, each one's rounds in order: the update's round rows."""
    return [(offset + k, completions[k], rnd) for k in ks
            for rnd in trace_rounds(completions[k].step_map, len(completions[k].prompt_ids), block_size,
                                    completions[k].tail_step_map)]


def update_plan(completions, advantages, cfg, rt, block_size: int, mask_id: int, pad_id: int, use_flex: bool,
                seed: int = 0) -> tuple[list[list[PackedBatch]], int, int]:
    """The update's micro-batches, per optimiser step (module docstring): the kept
    responses' trace rounds as round rows, split into U optimiser steps (U = `updates_per_step`, or
    with 0 one per `rows_per_update` round rows of all processes, as in DICE; step u holds each
    process's u-th run of rows, `minibatches`, shuffled with seed + rank under `--minibatch-order
    shuffle`), each step's rows weighted by `row_weights` and packed into micro-batches of
    `update_tokens` tokens. Returns (the micro-batches of every step, the responses and the round
    rows of all processes). Under FSDP every backward is a collective, so each rank runs as many
    micro-batches as the busiest rank, padding with empty ones. use_flex: each micro-batch is one
    row padded to `dice.model.packing.flex_length`, so every micro-batch of every step has the shape
    [1, update_tokens] but for a group over the budget ([1, m x update_tokens], m the fewest
    budgets that hold it); otherwise one unpadded row per group, as the dense mask wants."""
    kept = [k for k, a in enumerate(advantages) if a is not None and completions[k].tokens]
    n_responses = int(rt.all_sum(len(kept)))
    items = round_items(completions, kept, block_size)
    n_rows = int(rt.all_sum(len(items)))
    if n_responses == 0:
        return [], 0, 0
    U = cfg.updates_per_step or max(1, math.ceil(n_rows / cfg.rows_per_update))
    width = int(rt.all_max(max((len(completions[k].tokens) for k in kept), default=0)))   # L1
    plan = []
    for step in minibatches(items, U, cfg.minibatch_order, seed + rt.rank):
        weights = row_weights(step, cfg.loss_norm, width=width, rows=int(rt.all_sum(len(step))),
                              responses=n_responses, updates=U)
        groups = group_rounds(step, weights, cfg.update_rows, block_size, cfg.update_tokens)
        batches = [pack([chunk] if use_flex else [[g] for g in chunk], mask_id, pad_id, advantages)
                   for chunk in micro_batches(groups, cfg.update_tokens)]
        batches += [empty_batch(block_size, pad_id)] * (int(rt.all_max(len(batches))) - len(batches))
        if use_flex:
            batches = [pad_batch(b, flex_length(b.ids.shape[1], cfg.update_tokens)) for b in batches]
        plan.append(batches)
    return plan, n_responses, n_rows


# ---------------------------------------------------------------- old log-probs, beside the reward's tail

class OldLogprobs:
    """Old log-probs by (response k, round index), for one RL step. Called by
    `dice.rl.rollout.generate_and_score` once the last response is generated, with the step's
    completions (k counted from `offset`: a dynamic-sampling round's first) and `finished()`,
    true once the reward is in; `old(batch)` gives an update micro-batch's, or None. Not under
    torchrun: under FSDP every forward is a collective that all processes must run alike.
    `compile_s`: what its FlexAttention forwards spent compiling (`CompileClock`). Its micro-batches
    have the update's budget (`tokens`: the run's `UpdateTokens.for_forwards`, asked when the pass
    starts; None: one of its own that holds no optimiser state), so both meet one FlexAttention shape."""

    def __init__(self, model, cfg, rt, pad_id: int, tokens: UpdateTokens | None = None):
        self.model, self.cfg, self.rt, self.pad_id = model, cfg, rt, pad_id
        self.tokens = tokens or UpdateTokens(model, None, rt)
        self.values: dict[tuple[int, int], torch.Tensor] = {}
        self.compile_s = 0.0

    def __call__(self, completions: list, finished, offset: int = 0) -> None:
        if self.rt.world > 1 or finished():
            return
        config, device = self.model.config, compute_device(self.model)
        use_flex = uses_flex(self.cfg, device)
        items = round_items(completions, [k for k, c in enumerate(completions) if c is not None and c.tokens],
                            config.block_size, offset)
        budget = self.tokens.for_forwards(self.cfg, completions)
        groups = group_rounds(items, [0.0] * len(items), self.cfg.update_rows, config.block_size, budget)
        clock = CompileClock.for_masks(use_flex, device)
        zero = dict.fromkeys((k for k, _, _ in items), 0.0)
        for chunk in micro_batches(groups, budget):
            if finished():
                break
            batch = pack([chunk] if use_flex else [[g] for g in chunk], config.mask_token_id, self.pad_id, zero)
            if use_flex:
                batch = pad_batch(batch, flex_length(batch.ids.shape[1], budget))
            with torch.no_grad(), self.rt.autocast(self.cfg.dtype):
                logp = clock.run("forward", batch, lambda: packed_logprobs(self.model, batch, use_flex))
            for (k, r, _), values in zip(batch.rounds, logp.split([n for _, _, n in batch.rounds])):
                self.values[(k, r)] = values
        self.compile_s += clock.seconds()

    def old(self, batch: PackedBatch) -> torch.Tensor | None:
        """`batch`'s old log-probs in its loss order, or None if a round of it was not computed."""
        if not batch.rounds or any((k, r) not in self.values for k, r, _ in batch.rounds):
            return None
        return torch.cat([self.values[(k, r)] for k, r, _ in batch.rounds])


# ---------------------------------------------------------------- the loss and the optimiser steps

def policy_update(model, ref_model, completions, advantages, cfg, rt, optimizer, pad_id: int, seed: int = 0,
                  progress=None, old_logprobs: OldLogprobs | None = None,
                  tokens: UpdateTokens | None = None) -> dict:
    """The optimiser steps of one RL step over the kept responses' trace rounds (`update_plan`), in
    micro-batches of the budget `tokens` gives now (the run's `UpdateTokens`: --update-tokens, or
    planned from the GPU memory free; None: one of this call's own).
    The token weights count rows and responses over all processes, so a micro-batch's backward is
    already its share of the step; with several steps the ratio is to the rollout policy's
    log-probs, taken before the first (those `old_logprobs` computed while the reward finished,
    `OldLogprobs`, and the rest here). progress(done, total) follows the micro-batches, from 0. kl and
    clip_fraction are means over every loss token of all processes; flops is the update's model
    FLOPs (`dice.model.packing.update_flops`), all processes'; compile_s the seconds it spent compiling
    FlexAttention (`CompileClock`; the slowest process's): a process's first update, 0 after;
    grad_norm the whole gradient's norm before clipping, the mean over the optimiser steps;
    update_tokens the micro-batches' budget."""
    config = model.config
    device = compute_device(model)
    use_flex = uses_flex(cfg, device)
    kept = [c for c, a in zip(completions, advantages) if a is not None]
    budget = (tokens or UpdateTokens(model, optimizer, rt))(cfg, kept)
    cfg = dataclasses.replace(cfg, update_tokens=budget)
    plan, n_responses, n_rows = update_plan(completions, advantages, cfg, rt, config.block_size,
                                            config.mask_token_id, pad_id, use_flex, seed)
    if not plan:   # every group had equal rewards: no signal, and Adam's momentum must not move us
        return {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "responses_trained": 0, "rounds": 0, "flops": 0.0,
                "compile_s": 0.0, "grad_norm": 0.0, "update_tokens": budget}
    try:
        return _run_plan(model, ref_model, plan, n_responses, n_rows, cfg, rt, optimizer, use_flex, progress,
                         old_logprobs) | {"update_tokens": budget}
    except torch.OutOfMemoryError:
        fix = f"--update-tokens {max(budget // 2, 1)}"
        if not (cfg.gradient_checkpointing or model.gradient_checkpointing):   # nor turned on by the budget's plan
            fix += f" or {CHECKPOINTING}"
        raise out_of_memory("the RL update", device, f"micro-batches of {budget} tokens", fix) from None


def _run_plan(model, ref_model, plan, n_responses: int, n_rows: int, cfg, rt, optimizer, use_flex: bool, progress,
              old_logprobs) -> dict:
    """`policy_update`'s passes over its plan: the old log-probs (with U > 1), then each optimiser
    step's micro-batches, its clip and its step."""
    config, device = model.config, compute_device(model)
    clock = CompileClock.for_masks(use_flex, device)
    U, total = len(plan), sum(map(len, plan))
    flops = sum(update_flops(config, b) for step in plan for b in step)
    if progress is not None:   # the update's start, before a first compile or the old log-probs' pass
        progress(0, total)
    old = None
    if U > 1:   # the rollout policy's log-probs, before the first update
        def old_of(b: PackedBatch) -> torch.Tensor:
            nonlocal flops
            kept = old_logprobs.old(b) if old_logprobs is not None else None
            if kept is not None:
                return kept
            flops += update_flops(config, b, backward=False)
            return clock.run("forward", b, functools.partial(packed_logprobs, model, b, use_flex))

        with torch.no_grad(), rt.autocast(cfg.dtype):
            old = [[old_of(b) for b in step] for step in plan]
    if ref_model is not None:
        flops += sum(update_flops(config, b, backward=False) for step in plan for b in step)
    loss_sum, kl_sum, clipped, n_tokens, done, norm_sum = 0.0, 0.0, 0.0, 0, 0, 0.0
    for u, step in enumerate(plan):
        for i, batch in enumerate(step):
            loss, s = clock.run("train", batch, functools.partial(
                _train_micro_batch, model, ref_model, batch, old[u][i] if old else None, cfg, rt, use_flex))
            n = batch.advantage.numel()
            loss_sum, kl_sum, clipped, n_tokens = (loss_sum + loss / U, kl_sum + s["kl"] * n,
                                                   clipped + s["clip_fraction"] * n, n_tokens + n)
            done += 1
            if progress is not None:
                progress(done, total)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        norm_sum += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)   # FSDP2: a DTensor
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    n_tokens = rt.all_sum(n_tokens)
    return {"loss": rt.all_sum(loss_sum), "kl": rt.all_sum(kl_sum) / max(n_tokens, 1),
            "clip_fraction": rt.all_sum(clipped) / max(n_tokens, 1), "responses_trained": n_responses,
            "rounds": n_rows, "flops": rt.all_sum(flops), "compile_s": rt.all_max(clock.seconds()),
            "grad_norm": norm_sum / U}


def _train_micro_batch(model, ref_model, batch: PackedBatch, logp_old: torch.Tensor | None, cfg, rt,
                       use_flex: bool) -> tuple[float, dict]:
    """One micro-batch's forward and backward, its gradient added to the parameters': (its loss,
    `policy_loss`'s stats). logp_old None: on-policy, the ratio to its own detached log-probs."""
    with rt.autocast(cfg.dtype):
        logp = packed_logprobs(model, batch, use_flex)
        logp_ref = None
        if ref_model is not None:
            with torch.no_grad():
                logp_ref = packed_logprobs(ref_model, batch, use_flex)
    tok_loss, stats = policy_loss(logp, logp.detach() if logp_old is None else logp_old,
                                  batch.advantage.to(logp.device), clip_eps=cfg.clip_eps, kl_beta=cfg.kl_beta,
                                  logp_ref=logp_ref)
    loss = (tok_loss * batch.token_weight.to(logp.device)).sum()
    (loss * rt.world).backward()   # FSDP averages over ranks; weights already use the global count
    return loss.item(), stats


def policy_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, advantage: torch.Tensor, *, clip_eps: float,
                kl_beta: float, logp_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Per-token PPO-clip loss plus beta * k3 KL (module docstring); returns (loss [N], stats)."""
    ratio = torch.exp(logp_new - logp_old)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    pg = -torch.minimum(ratio * advantage, clipped * advantage)
    ref = logp_old if logp_ref is None else logp_ref
    log_r = ref - logp_new
    k3 = torch.exp(log_r) - log_r - 1
    stats = {"clip_fraction": float(((ratio - clipped).abs() > 0).float().mean()) if ratio.numel() else 0.0,
             "kl": float(k3.detach().mean()) if k3.numel() else 0.0}
    return pg + kl_beta * k3, stats


def restart_moments(optimizer, lifetime: str) -> None:
    """`--optimizer-state step` (DICE): forget AdamW's moments and step counts after each RL step's
    update, so the next update's first optimiser step is Adam's first again and the rollouts in
    between have the moments' memory (twice the float32 weights) for a larger batch. DICE runs
    every RL step's update as a new process (`training/RL/rl.py`: `accelerate launch
    train/rl_sdar.py` per step) that builds a new AdamW (`rl_sdar.py` line 206) and saves only the
    model (line 831). `run` keeps them for the whole run."""
    if lifetime == "step":
        optimizer.state.clear()
