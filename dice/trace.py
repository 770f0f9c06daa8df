"""TraceRL's replay of a rollout (DESIGN.md §7): training rounds from the sampler's step map, the
doubled round sequences they make, and their log-probs under the policy.

Trace -> training rounds (`trace_rounds`): the sampler's step map says when every response token
was unmasked. For each block (on the absolute grid, the prompt's tail included) the distinct
step values s_1 < s_2 < ... are its rounds; round r replays the state the sampler saw at that
block's r-th step: tokens unmasked at step >= s_r are MASK, earlier ones clean, and the loss
counts the tokens unmasked at s_r. Blocks never see each other's noisy halves, so round r of
every block shares one doubled sequence [x_t ; x_0]: a response costs max_b(#rounds) forwards.
The sampler denoises whole blocks and then cuts the response, so the last block's positions after
the cut (the completion's tail) were context at each of that block's steps: they join the replay
in the same MASK-or-clean state, but never the loss, and a step that unmasked only tail positions
is not a round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .diffusion import doubled_logits
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


@dataclass
class RoundBatch:
    """Doubled training sequences of several rounds, padded to one length."""
    noisy: torch.Tensor        # [B, n]
    clean: torch.Tensor        # [B, n]
    position_ids: torch.Tensor
    sample_ids: torch.Tensor   # 0 for prompt, response and tail, -1 for padding (never attended)
    loss_at: torch.Tensor      # [B, n] bool
    token_weight: torch.Tensor  # [N] each loss token's weight in its optimiser step's loss (`row_weights`)
    advantage: torch.Tensor    # [N]


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


def build_round_batch(items: list[tuple[int, Completion, Round]], block_size: int, mask_id: int, pad_id: int,
                      advantages: Sequence[float], weights: Sequence[float]) -> RoundBatch:
    """One row per (response k, completion, round): prompt + response + tail, MASK at the round's
    masked positions in the noisy half; every loss token of row i weighs weights[i]. The tail is
    context of its own sample, as it was to the sampler, but never in the loss."""
    n = max(len(c.prompt_ids) + len(c.tokens) + len(c.tail_tokens) for _, c, _ in items)
    n = -(-n // block_size) * block_size
    B = len(items)
    clean = torch.full((B, n), pad_id, dtype=torch.long)
    sample = torch.full((B, n), -1, dtype=torch.long)
    loss_at = torch.zeros(B, n, dtype=torch.bool)
    token_weight, adv = [], []
    for row, (k, c, rnd) in enumerate(items):
        seq = c.prompt_ids + c.tokens + c.tail_tokens
        clean[row, :len(seq)] = torch.tensor(seq)
        sample[row, :len(seq)] = 0
        loss_at[row, rnd.loss] = True
        token_weight += [weights[row]] * len(rnd.loss)
        adv += [advantages[k]] * len(rnd.loss)
    noisy = clean.clone()
    for row, (_, _, rnd) in enumerate(items):
        noisy[row, rnd.masked] = mask_id
    return RoundBatch(noisy, clean, torch.arange(n).expand(B, n).clone(), sample, loss_at,
                      torch.tensor(token_weight), torch.tensor(adv))


def flex_shape(rows: int, n: int) -> tuple[int, int]:
    """The padded shape of a round batch on the FlexAttention path: rows up to a power of two, the
    length up to a multiple of 128 up to 1024, then of a quarter octave (1280, 1536, 1792, 2048,
    2560, ...: under 25% padding, about 10% on average). Compiled FlexAttention compiles once per
    shape; round batches of every length then cost a dozen compiles per process, all reused by
    later steps, instead of one compile (tens of seconds) per micro-batch."""
    step = 128 if n <= 1024 else 1 << ((n - 1).bit_length() - 3)
    return 1 << (rows - 1).bit_length(), -(-n // step) * step


def pad_round_batch(batch: RoundBatch, rows: int, n: int) -> RoundBatch:
    """`batch` padded to [rows, n] with padding (token 0, sample -1: never attended, no loss), so
    its loss positions and their order are unchanged."""
    def pad(t: torch.Tensor, value) -> torch.Tensor:
        out = t.new_full((rows, n), value)
        out[:t.shape[0], :t.shape[1]] = t
        return out

    positions = torch.arange(n).expand(rows, n).clone()   # padding goes on along the grid
    positions[:batch.position_ids.shape[0], :batch.position_ids.shape[1]] = batch.position_ids
    return RoundBatch(pad(batch.noisy, 0), pad(batch.clean, 0), positions, pad(batch.sample_ids, -1),
                      pad(batch.loss_at, False), batch.token_weight, batch.advantage)


def round_logprobs(model, batch: RoundBatch, use_flex: bool | None = None) -> torch.Tensor:
    """log p(x_0 token | x_t) at every loss position, in `loss_at` order: [N], from the doubled
    forward that SFT uses too (`dice.diffusion.doubled_logits`).

    use_flex (None: on CUDA) attends through the block-sparse FlexAttention mask, which skips the
    ~3/4 of [x_t ; x_0]'s query-key blocks the rule hides (a dense mask computes them all), after
    padding the batch to `flex_shape` so that the compiled kernel meets only a few shapes."""
    device = next(model.parameters()).device
    if use_flex is None:
        use_flex = device.type == "cuda"
    if use_flex:
        batch = pad_round_batch(batch, *flex_shape(*batch.clean.shape))
    to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    logits = doubled_logits(model, to(batch.noisy), to(batch.clean), to(batch.position_ids), to(batch.sample_ids),
                            to(batch.loss_at), use_flex).float()
    return -F.cross_entropy(logits, to(batch.clean)[to(batch.loss_at)], reduction="none")
