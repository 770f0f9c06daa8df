"""TraceRL's replay of a rollout (DESIGN.md §7): training rounds from the sampler's step map, and
the weight of each round row's loss tokens.

Trace -> training rounds (`trace_rounds`): the sampler's step map says when every response token
was unmasked. For each block (on the absolute grid, the prompt's tail included) the distinct
step values s_1 < s_2 < ... are its rounds; round r replays the state the sampler saw at that
block's r-th step: tokens unmasked at step >= s_r are MASK, earlier ones clean, and the loss
counts the tokens unmasked at s_r. Blocks never see each other's noisy copies, so round r of
every block shares one round row: a response has max_b(#rounds) rows (`dice.packing` lays them
out beside one clean stream). The sampler denoises whole blocks and then cuts the response, so
the last block's positions after the cut (the completion's tail) were context at each of that
block's steps: they join the replay in the same MASK-or-clean state, but never the loss, and a
step that unmasked only tail positions is not a round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .rollout import Completion


@dataclass
class Round:
    masked: list[int]      # positions (in prompt + response) that are MASK in the noisy copy
    loss: list[int]        # positions whose loss counts (unmasked at this round's step)


def trace_rounds(step_map: Sequence[int], prompt_len: int, block_size: int,
                 tail_step_map: Sequence[int] = ()) -> list[Round]:
    """Training rounds of one rollout (module docstring); positions index prompt + response + tail.

    A block's rounds are the distinct steps s_r of its response tokens; round r masks the block's
    positions, tail included, with step >= s_r and counts the response tokens with step == s_r."""
    blocks: dict[int, list[tuple[int, int, bool]]] = {}
    for i, step in enumerate([*step_map, *tail_step_map]):
        pos = prompt_len + i
        blocks.setdefault(pos // block_size, []).append((pos, step, i < len(step_map)))
    rounds: list[Round] = []
    for tokens in blocks.values():
        for r, s in enumerate(sorted({step for _, step, in_response in tokens if in_response})):
            if r == len(rounds):
                rounds.append(Round([], []))
            rounds[r].masked += [p for p, step, _ in tokens if step >= s]
            rounds[r].loss += [p for p, step, in_response in tokens if step == s and in_response]
    for rnd in rounds:
        rnd.masked.sort()
        rnd.loss.sort()
    return rounds


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
