"""Masked block diffusion for training (DESIGN.md §4): forward noising, the doubled-sequence
forward, and the loss.

Forward process, per (packed) sample: t ~ U(0, 1), p = (1 - eps) t + eps with eps = 1e-3, and
each response token is replaced by MASK independently with probability p (the prompt never is;
at least one response token always is). The model sees `[x_t ; x_0]` (both halves at positions
0..n-1) under the block-diffusion mask, so every noisy block is denoised given the clean blocks
before it, exactly the state the sampler is in. The loss is the ELBO weighting, read from the
noisy half only (logits are computed just for the masked positions), normalised one of two ways:

    batch   (JetAstra/SDAR `modeling_sdar.py`: CE with reduction='sum', then `/ answer_len`)
            L = sum over the micro-batch's masked response tokens of CE(x_0 | x_t) / p,
                divided by the number of response tokens in the micro-batch: every token weighs the same;
    sample  L = sum over samples of (1 / |response|) * sum over its masked tokens of CE / p,
            to be divided by the number of samples: each sample weighs the same, a long one's tokens less.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.attention import block_diffusion_mask, flex_block_diffusion_mask
from ..model.sdar import compute_device

EPS = 1e-3


def mask_probability(t: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return (1 - eps) * t + eps


def add_noise(input_ids: torch.Tensor, loss_mask: torch.Tensor, sample_ids: torch.Tensor, mask_token_id: int,
              generator: torch.Generator, eps: float = EPS):
    """Mask response tokens of every packed sample at its own rate (CPU, seeded).

    input_ids, loss_mask (True = response token), sample_ids (>= 0 for real tokens): [B, n].
    Returns (noisy_ids, masked [B, n] bool, p [B, n] the mask probability of each token's sample).
    """
    B, n = input_ids.shape
    n_samples = int(sample_ids.max()) + 1 if sample_ids.numel() else 1
    t = torch.rand(B, n_samples, generator=generator)
    p = mask_probability(t, eps).gather(1, sample_ids.clamp(min=0))
    masked = (torch.rand(B, n, generator=generator) < p) & loss_mask
    # guarantee one masked token per sample that has a response: mask its highest random score
    key = sample_ids.clamp(min=0) + torch.arange(B)[:, None] * n_samples
    has_masked = torch.zeros(B * n_samples, dtype=torch.bool).index_put_((key[masked],), torch.tensor(True))
    needs = loss_mask & ~has_masked[key]
    if needs.any():
        score = torch.rand(B, n, generator=generator).masked_fill(~needs, -1.0)
        best = torch.full((B * n_samples,), -1.0).scatter_reduce(0, key.flatten(), score.flatten(), "amax")
        masked |= needs & (score == best[key])
    return input_ids.masked_fill(masked, mask_token_id), masked, p


def token_weights(loss_mask: torch.Tensor, sample_ids: torch.Tensor, p: torch.Tensor, norm: str) -> torch.Tensor:
    """Each token's weight in the loss (module docstring), [B, n], 0 where no response: `batch`,
    1 / (p * response tokens of the whole batch); `sample`, 1 / (p * |response of its sample|)."""
    if norm == "batch":
        return loss_mask.float() / (p * loss_mask.sum().clamp(min=1))
    B, n = loss_mask.shape
    key = sample_ids.clamp(min=0) + torch.arange(B, device=loss_mask.device)[:, None] * n
    resp_len = torch.zeros(B * n, device=loss_mask.device).index_add_(0, key.flatten(), loss_mask.flatten().float())
    return loss_mask.float() / (p * resp_len[key].clamp(min=1))


def count_samples(loss_mask: torch.Tensor, sample_ids: torch.Tensor) -> int:
    """Number of packed samples with at least one response token in a [B, n] batch."""
    key = sample_ids + torch.arange(loss_mask.shape[0], device=loss_mask.device)[:, None] * (loss_mask.shape[1] + 1)
    return int(key[loss_mask].unique().numel())


def doubled_logits(model, noisy_ids, clean_ids, position_ids, sample_ids, logits_at, use_flex: bool):
    """Logits at the `logits_at` [B, n] positions of x_t in the doubled forward over [x_t ; x_0]."""
    make_mask = flex_block_diffusion_mask if use_flex else block_diffusion_mask
    mask = make_mask(position_ids, model.config.block_size, sample_ids)
    ids = torch.cat([noisy_ids, clean_ids], dim=1)
    pos = torch.cat([position_ids, position_ids], dim=1)
    return model(ids, pos, mask, logits_at=torch.cat([logits_at, torch.zeros_like(logits_at)], dim=1))


def diffusion_loss(model, batch: dict, generators: list[torch.Generator], mask_token_id: int, *,
                   norm: str = "batch", use_flex: bool = False, eps: float = EPS) -> torch.Tensor:
    """The loss of one micro-batch (module docstring): `batch`, SDAR's mean over its response
    tokens; `sample`, the sum over its samples (divide by the step's number of samples).

    batch: `input_ids`, `position_ids`, `sample_ids`, `loss_mask` [B, n] CPU tensors (dice.sft.data);
    row i is noised with generators[i], so a row's noise does not depend on how rows are split
    into micro-batches or processes.
    """
    noised = [add_noise(*(batch[k][i:i + 1] for k in ("input_ids", "loss_mask", "sample_ids")), mask_token_id, g, eps)
              for i, g in enumerate(generators)]
    noisy, masked, p = (torch.cat(t) for t in zip(*noised))
    weights = token_weights(batch["loss_mask"], batch["sample_ids"], p, norm)[masked]
    device = compute_device(model)
    to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    logits = doubled_logits(model, to(noisy), to(batch["input_ids"]), to(batch["position_ids"]),
                            to(batch["sample_ids"]), to(masked), use_flex)
    ce = F.cross_entropy(logits.float(), to(batch["input_ids"][masked]), reduction="none")
    return (ce * to(weights)).sum()
