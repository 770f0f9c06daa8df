"""Model parity against golden logits of an independent float64 Qwen3 implementation."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dice import load_model
from dice.model.attention import attend, block_causal_mask, block_diffusion_mask, folded_attention_bias

TINY = Path(__file__).parent / "fixtures" / "tiny-sdar"


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY), load_file(TINY / "golden.safetensors")


@torch.no_grad()
def test_causal_logits_match_golden(tiny):
    model, g = tiny
    L = g["input_ids"].shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    logits = model(g["input_ids"], g["position_ids"], causal)
    torch.testing.assert_close(logits, g["logits_causal"], atol=1e-4, rtol=0)


@torch.no_grad()
def test_default_mask_is_block_causal_and_matches_golden(tiny):
    model, g = tiny
    logits = model(g["input_ids"])
    torch.testing.assert_close(logits, g["logits_block_causal"], atol=1e-4, rtol=0)
    B, L = g["input_ids"].shape
    per_row = block_causal_mask(torch.arange(L), 4).expand(B, L, L)
    torch.testing.assert_close(model(g["input_ids"], g["position_ids"], per_row), logits, atol=1e-5, rtol=0)


@torch.no_grad()
def test_training_forward_matches_golden(tiny):
    model, g = tiny
    n = g["input_ids"].shape[1]
    mask = block_diffusion_mask(g["train_position_ids"][:, :n], model.config.block_size)
    logits = model(g["train_input_ids"], g["train_position_ids"], mask)
    torch.testing.assert_close(logits[:, :n], g["train_noisy_logits"], atol=1e-4, rtol=0)


def test_block_diffusion_mask_hand_computed():
    # n = 6, block 2: blocks 0 0 1 1 2 2 in each half; rows = queries, N = noisy, C = clean.
    N = ["110000", "110000", "001100", "001100", "000011", "000011"]
    NC = ["000000", "000000", "110000", "110000", "111100", "111100"]
    CC = ["110000", "110000", "111100", "111100", "111111", "111111"]
    rows = [a + b for a, b in zip(N, NC)] + ["000000" + c for c in CC]
    expected = torch.tensor([[ch == "1" for ch in r] for r in rows])
    got = block_diffusion_mask(torch.arange(6), 2)[0]
    assert torch.equal(got, expected)


def test_block_diffusion_mask_packing_isolates_samples():
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    sample = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    mask = block_diffusion_mask(pos, 2, sample)[0]
    alone = block_diffusion_mask(torch.arange(4), 2)[0]
    # the second sample sees exactly what it would see alone, and nothing of the first
    idx = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])
    assert torch.equal(mask[idx][:, idx], alone)
    first = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])
    assert not mask[idx][:, first].any() and not mask[first][:, idx].any()


@torch.no_grad()
def test_kv_cache_equals_full_forward(tiny):
    """Prefill full blocks, run the next block against the cache without storing it, store it,
    run the one after: each matches the block-causal full forward."""
    model, g = tiny
    ids = g["input_ids"][:, :16]
    full = model(ids)
    B = ids.shape[0]
    cache = model.new_cache(B, 32)
    pos = torch.arange(16).expand(B, 16)
    out = model.forward_cached(ids[:, :8], pos[:, :8], cache, commit=8)
    torch.testing.assert_close(out, full[:, :8], atol=1e-5, rtol=0)
    scratch = model.forward_cached(ids[:, 8:12], pos[:, 8:12], cache, commit=0)
    torch.testing.assert_close(scratch, full[:, 8:12], atol=1e-5, rtol=0)
    assert cache.length == 8
    model.forward_cached(ids[:, 8:12], pos[:, 8:12], cache, commit=4)
    fused = model.forward_cached(ids[:, 12:16], pos[:, 12:16], cache, commit=0)
    torch.testing.assert_close(fused, full[:, 12:16], atol=1e-5, rtol=0)


@torch.no_grad()
def test_kv_cache_left_padding_is_invisible(tiny):
    model, g = tiny
    ids = g["input_ids"][:1, :8]
    alone = model(ids)
    pad = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    pos = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.arange(8)[None]], dim=1)
    valid = torch.arange(12)[None] >= 4
    cache = model.new_cache(1, 16)
    out = model.forward_cached(pad, pos, cache, commit=12, valid=valid)
    torch.testing.assert_close(out[:, 4:], alone, atol=1e-5, rtol=0)


def test_bad_mask_shape_is_a_clear_error(tiny):
    model, g = tiny
    with pytest.raises(ValueError, match=r"attention_mask must be a bool tensor of shape \[L, L\]"):
        model(g["input_ids"], attention_mask=torch.ones(3, 3, dtype=torch.bool))


@pytest.mark.parametrize("batch, lq", [(2, 5), (2, 40), (70, 5)])
def test_folded_bias_attends_like_the_bool_mask_and_like_repeated_keys(batch, lq, monkeypatch):
    """GQA (8 query heads on 2 KV heads) with a once-per-forward bias equals the bool mask and the
    textbook form: keys/values repeated per query head, softmax over masked scores. Batch 2 with 5
    queries (20 folded rows, 4 batch-head pairs) takes the decoding path of explicit products; 40
    queries (160 rows) and batch 70 (140 pairs) take SDPA."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, h, t, 16, generator=gen, dtype=torch.float64)
               for h, t in ((8, lq), (2, 9), (2, 9)))
    mask = torch.rand(batch, 1, lq, 9, generator=gen) > 0.4
    mask[..., 0] = True                                              # every row keeps a key
    k_rep, v_rep = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    scores = (q @ k_rep.transpose(-1, -2) / 4.0).masked_fill(~mask, float("-inf"))
    textbook = scores.softmax(-1) @ v_rep
    torch.testing.assert_close(attend(q, k, v, mask), textbook)
    sdpa_calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: sdpa_calls.append(1) or sdpa(*a, **kw))
    torch.testing.assert_close(attend(q, k, v, folded_attention_bias(mask, 4, torch.float64)), textbook)
    assert len(sdpa_calls) == (0 if (batch, lq) == (2, 5) else 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decoding_attention_in_bf16_is_as_accurate_as_sdpa(device):
    """The decoding path's scores must not be rounded to bf16 before the softmax: with large
    scores (peaked attention) its error against float64 stays at SDPA's (which keeps float32
    scores), not the ~7x larger error of bf16 scores. On CUDA the path is cuBLAS's float32 output."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, t, 64, generator=gen, dtype=torch.float64) for h, t in ((8, 4), (2, 257), (2, 257)))
    q = 6 * q                                                        # scaled scores up to ~25
    mask = torch.ones(2, 1, 4, 257, dtype=torch.bool)
    mask[..., -4:] = False
    q16, k16, v16 = (x.to(device, torch.bfloat16) for x in (q, k, v))
    mask = mask.to(device)
    k_rep, v_rep = (x.double().repeat_interleave(4, dim=1) for x in (k16, v16))
    scores = (q16.double() @ k_rep.transpose(-1, -2) / 8.0).masked_fill(~mask, float("-inf"))
    exact = scores.softmax(-1) @ v_rep                               # float64 from the same bf16 inputs
    sdpa = torch.nn.functional.scaled_dot_product_attention(q16, k16.repeat_interleave(4, 1),
                                                            v16.repeat_interleave(4, 1), attn_mask=mask)
    fast = attend(q16, k16, v16, folded_attention_bias(mask, 4, torch.bfloat16))
    sdpa_err, fast_err = ((x.double() - exact).abs().max().item() for x in (sdpa, fast))
    assert fast_err <= 2 * sdpa_err, (fast_err, sdpa_err)
