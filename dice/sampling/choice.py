"""What one denoising step chooses (DESIGN.md §5): tokens per step, sampling noise, the token and its
confidence at every masked position, and which positions it unmasks. `dice.sampling.sampler` runs these
over blocks; they are plain tensor functions.

    n_s = floor(B / S) + [s < B mod S]                       (tokens per step, from the block size)
    c   = p(token) under the temperature softmax before top-k / top-p (temperature 0: argmax,
          c = its softmax probability); the mask token is never sampled. confidence="filtered" is
          DICE's instead: p(token) after the filter, so under top_k=1 every position's c is 1 (1/m
          where m tokens tie for the top logit) and the order comes from the tie rule below
    low_confidence_static:  unmask the n_s masked positions with the highest c;
    low_confidence_dynamic: unmask every masked position with c > threshold, or the top n_s if
                            fewer qualify.
Sampling noise is a hash of (row seed, row step, position), so a batch does not change a row's draws.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

REMASKING = ("low_confidence_static", "low_confidence_dynamic")
CONFIDENCE = ("softmax", "filtered")


@dataclass(frozen=True)
class Sampling:
    """How the sampler decodes a block (the rules: the module docstring). steps_per_block: S, the
    denoising steps of a block; remasking: which masked positions a step unmasks, "low_confidence_static"
    or "low_confidence_dynamic" (with its confidence `threshold`); temperature: 0 is greedy; top_k:
    sample among the k likeliest tokens (0: all); top_p: nucleus sampling, in (0, 1]; confidence:
    "softmax" (DESIGN.md §5) or DICE's "filtered" (needs temperature > 0; `evaluate.py --protocol
    dice`). A value no step could use is a ValueError here."""
    steps_per_block: int = 4
    remasking: str = "low_confidence_static"
    threshold: float = 0.9
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    confidence: str = "softmax"

    def __post_init__(self):
        if self.remasking not in REMASKING:
            raise ValueError(f"remasking must be one of {REMASKING}, got {self.remasking!r}")
        if self.steps_per_block < 1:
            raise ValueError(f"steps_per_block must be >= 1, got {self.steps_per_block}")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.threshold <= 1:
            raise ValueError(f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1 and 0 <= threshold <= 1; got "
                             f"{self.temperature}, {self.top_k}, {self.top_p}, {self.threshold}")
        if self.confidence not in CONFIDENCE or (self.confidence == "filtered" and self.temperature == 0):
            raise ValueError(f"confidence must be one of {CONFIDENCE} (filtered: with temperature > 0), "
                             f"got {self.confidence!r}")


def tokens_per_step(block_size: int, steps: int) -> list[int]:
    """n_s = floor(B / S) + [s < B mod S] for s = 0..S-1."""
    return [block_size // steps + (s < block_size % steps) for s in range(steps)]


_M32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), a deterministic function of (row seed, row step, position): [B], [B], [B, T]."""
    x = (positions * 0x9E3779B1 + (steps * 0x85EBCA77)[:, None] + seeds[:, None]) & _M32
    x = _fmix32(_fmix32(x) ^ seeds[:, None])
    return (x.double() + 0.5) / 2.0**32


def row_seeds(seed: int | Sequence[int] | None, n: int) -> list[int]:
    if seed is None:
        seed = int(torch.randint(0, 2**31, ()).item())
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed + i for i in range(n)]
    if len(seeds) != n:
        raise ValueError(f"got {len(seeds)} seeds for {n} prompts")
    out = []
    for s in seeds:  # fold an arbitrary int into 32 bits
        h = 0
        while True:
            h = (h * 0x01000193 ^ (s & _M32)) & _M32
            s >>= 32
            if s in (0, -1):
                break
        out.append(h)
    return out


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p          # keeps the first token always
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def greedy_choice(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, its softmax probability) per row of [..., V] float logits: the probability of the
    largest logit m is exp(0) / sum_j exp(l_j - m), so c = 1 / sum_j exp(l_j - m). Each reduction
    runs over V cut into `pieces` and then over the pieces: a decoding step has a few rows, and a
    reduction per row would leave all but a few SMs idle (a [4, 151936] softmax takes ~40 us on an
    H200). The argmax is the first index of the maximum, as `max` gives it."""
    V = logits.shape[-1]
    pieces = math.gcd(V, 64)
    x = logits.reshape(*logits.shape[:-1], pieces, V // pieces)
    piece_max, piece_arg = x.max(-1)
    m, piece = piece_max.max(-1)                     # the first piece that holds the maximum
    tok = piece * (V // pieces) + piece_arg.gather(-1, piece.unsqueeze(-1)).squeeze(-1)
    total = (x - m[..., None, None]).exp_().sum(-1).sum(-1)
    return tok, total.reciprocal_()


def choose_tokens(logits: torch.Tensor, mask_token_id: int, temperature: float, top_k: int, top_p: float,
                  uniforms: torch.Tensor | None, confidence: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """(token, confidence) per position of [B, T, V] logits; see the module docstring. confidence
    "filtered" (DICE's `sample_with_temperature_topk_topp`, evaluation/scripts/sdar_utils.py: the
    probability of the token under the softmax of the filtered logits) needs temperature > 0."""
    logits = logits.to(torch.float32, copy=True)   # a copy: the input may be a CUDA graph's output buffer
    logits[..., mask_token_id] = float("-inf")
    if temperature == 0:
        return greedy_choice(logits)
    scaled = logits / temperature
    probs = scaled.softmax(-1)
    filtered = filter_logits(scaled, top_k, top_p)
    # without top-k / top-p (DICE's RL rollouts) the kept distribution is probs itself: one softmax over V
    kept = probs if filtered is scaled else filtered.softmax(-1)
    cdf = kept.cumsum(-1)
    total = cdf[..., -1:]
    # strictly below the total: a target rounded up to it would select past the last kept token
    # (clamped to the last id, which can be the mask or a filtered-out token)
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum((uniforms.unsqueeze(-1) * total.double()).float(), below_total)
    tok = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tok, (kept if confidence == "filtered" else probs).gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def select_positions(conf: torch.Tensor, masked: torch.Tensor, n: torch.Tensor, remasking: str,
                     threshold: float) -> torch.Tensor:
    """Which masked positions to unmask this step: [B, T] bool. n: [B] tokens this step per row
    (already min(n_s, masks left)). Ties go to the lower position, as with DICE's `torch.topk` on
    CUDA, whose kernel takes the first-seen positions among equal values."""
    score = conf.masked_fill(~masked, -1.0)
    order = score.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    top_n = rank < n[:, None]
    if remasking == "low_confidence_static":
        return top_n
    confident = masked & (conf > threshold)
    return torch.where((confident.sum(-1) >= n)[:, None], confident, top_n)


def unmask(tok: torch.Tensor, conf: torch.Tensor, x_block: torch.Tensor, step_map_block: torch.Tensor,
           masked: torch.Tensor, n: torch.Tensor, steps: torch.Tensor, remasking: str, threshold: float):
    """A step's commit on a block: the positions `select_positions` picks take their chosen token
    and the row's step count. Returns the block's new (tokens, step map, still-masked)."""
    chosen = select_positions(conf, masked, n, remasking, threshold)
    return (torch.where(chosen, tok, x_block), torch.where(chosen, steps[:, None], step_map_block),
            masked & ~chosen)
