"""TraceRL's replay of a rollout (DESIGN.md §7): training rounds from the sampler's step map, and
the weight of each round row's loss tokens.

Trace -> training rounds (`trace_rounds`): the sampler's step map says when every response token
was unmasked. For each block (on the absolute grid, the prompt's tail included) the distinct
step values s_1 < s_2 < ... are its rounds; round r replays the state the sampler saw at that
block's r-th step: tokens unmasked at step >= s_r are MASK, earlier ones clean, and the loss
counts the tokens unmasked at s_r. Blocks never see each other's noisy copies, so round r of
every block shares one round row: a response has max_b(#rounds) rows (`dice.rl.packing` lays them
out beside one clean stream). The sampler denoises whole blocks and then cuts the response, so
the last block's positions after the cut (the completion's tail) were context at each of that
block's steps: they join the replay in the same MASK-or-clean state, but never the loss, and a
step that unmasked only tail positions is not a round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .rollout import Completion


@dataclass
class Round:
    masked: list[int]      # positions (in prompt + response) that are MASK in the noisy copy
    loss: list[int]        # positions whose loss counts (unmasked at this round's step)
    index: int             # r: the response's round rows in order


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
