"""Attention masks, the attention kernel dispatch, and the KV cache (DESIGN.md §2, §5).

Three visibility rules are used in this project, all with "True = may attend":

* block-causal (inference): query i sees key j iff block(j) <= block(i), block(i) = pos(i) // B
  on the absolute position grid (the prompt included);
* block-diffusion (training): the clean stream x_0 (positions 0..n-1) beside noisy copies of it
  (SFT's doubled sequence [x_t ; x_0] has one; the RL update [x_t^1 ; ... ; x_t^R ; x_0] one per
  trace round, each holding some of the blocks at their positions). With b the block and s the
  stream (0 the clean stream, r >= 1 noisy copy r) of query q and key k:
      b_q == b_k and s_q == s_k            (bidirectional inside a block, within one stream)
      s_q >= 1, s_k == 0, b_q >  b_k       (a noisy block sees the clean past)
      s_q == 0, s_k == 0, b_q >= b_k       (the clean stream is block-causal)
  and with packing, q and k must also belong to the same sample. The clean stream sees no noisy
  copy, so its states, and with them every copy's, do not depend on which other copies share the
  sequence: R copies beside one clean stream give each copy what a doubled row of its own gives;
* cached decoding: a new token sees every committed key of its own sequence (padding excluded)
  plus the new tokens under the block-causal rule.

The block-diffusion predicate is one function used both for the dense CPU mask and as the
FlexAttention `mask_mod`, so the two cannot drift apart.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # torch < 2.5: dense masks only
    BlockMask = create_block_mask = flex_attention = None


def block_causal_mask(position_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., L] positions -> [..., L, L] mask: block(k) <= block(q)."""
    block = position_ids // block_size
    return block.unsqueeze(-1) >= block.unsqueeze(-2)


def block_diffusion_visible(q_block, k_block, q_stream, k_stream, q_sample, k_sample):
    """The block-diffusion training rule (module docstring), elementwise on broadcastable tensors."""
    q_clean, k_clean = q_stream == 0, k_stream == 0
    same_stream_block = (q_block == k_block) & (q_stream == k_stream)
    noisy_sees_past = ~q_clean & k_clean & (q_block > k_block)
    clean_causal = q_clean & k_clean & (q_block >= k_block)
    return (same_stream_block | noisy_sees_past | clean_causal) & (q_sample == k_sample)


def _doubled_descriptors(position_ids: torch.Tensor, block_size: int, sample_ids: torch.Tensor | None):
    """Per-token (block, stream, sample) of the doubled sequence [x_t ; x_0] from the [B, n] half's
    positions: the first half is noisy copy 1, the second the clean stream."""
    n = position_ids.shape[-1]
    block = (position_ids // block_size).repeat(1, 2)
    stream = (torch.arange(2 * n, device=position_ids.device) < n).long().expand_as(block)
    if sample_ids is None:
        sample_ids = torch.zeros_like(position_ids)
    return block, stream, sample_ids.repeat(1, 2)


def streams_mask(block: torch.Tensor, stream: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """Dense [B, L, L] training mask from each token's block, stream and sample, all [B, L]."""
    q = lambda t: t.unsqueeze(-1)  # noqa: E731 - broadcast along keys
    k = lambda t: t.unsqueeze(-2)  # noqa: E731 - broadcast along queries
    return block_diffusion_visible(q(block), k(block), q(stream), k(stream), q(sample), k(sample))


def flex_streams_mask(block: torch.Tensor, stream: torch.Tensor, sample: torch.Tensor):
    """The same rule as `streams_mask`, as a FlexAttention BlockMask (CUDA training)."""
    if create_block_mask is None:
        raise RuntimeError("FlexAttention needs torch >= 2.5; pass the dense block_diffusion_mask instead")

    def mask_mod(b, h, q_idx, kv_idx):
        return block_diffusion_visible(block[b, q_idx], block[b, kv_idx], stream[b, q_idx],
                                       stream[b, kv_idx], sample[b, q_idx], sample[b, kv_idx])

    L = block.shape[1]
    # compiled, mask creation visits block pairs instead of materialising [B, L, L]
    return create_block_mask(mask_mod, block.shape[0], None, L, L, device=block.device, _compile=block.is_cuda)


def block_diffusion_mask(position_ids: torch.Tensor, block_size: int,
                         sample_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Dense [B, 2n, 2n] training mask for `[x_t ; x_0]`.

    position_ids: [B, n] positions of one half (restarting at 0 for every packed sample);
    sample_ids: [B, n] which packed sample each token belongs to (None = one sample per row).
    """
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
        sample_ids = None if sample_ids is None else sample_ids.unsqueeze(0)
    return streams_mask(*_doubled_descriptors(position_ids, block_size, sample_ids))


def flex_block_diffusion_mask(position_ids: torch.Tensor, block_size: int,
                              sample_ids: torch.Tensor | None = None):
    """The same rule as `block_diffusion_mask`, as a FlexAttention BlockMask (CUDA training)."""
    return flex_streams_mask(*_doubled_descriptors(position_ids, block_size, sample_ids))


_compiled_flex = None
# Compiled FlexAttention compiles once per shape and grad mode. The RL update meets [1, budget]
# and rarely a multiple (`dice.model.packing.flex_length`), SFT its rows, benches several settings in one
# process: dynamo's default of 8 recompiles could be reached, after which every new shape would run
# the uncompiled kernel, which materialises the full score matrix.
FLEX_RECOMPILES = 64
# A float-bias (decoding) call uses explicit products when it has at most DECODE_ROWS folded query
# rows and fewer than DECODE_PAIRS (batch row, KV head) pairs: SDPA spreads its work over those
# pairs and query tiles, so with few of them most of the GPU's 132 SMs idle (H200).
DECODE_ROWS = 64
DECODE_PAIRS = 128


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v with GQA. q [B, H, Lq, D], k/v [B, Hkv, Lk, D].

    `mask` is a bool tensor broadcastable to [B, 1, Lq, Lk], a FlexAttention BlockMask, or an
    additive float bias from `folded_attention_bias` (decoding: built once per forward, not per layer).
    """
    global _compiled_flex
    # under autocast q/k leave RMSNorm and RoPE in float32 while v leaves its Linear in bf16
    q, k = q.to(v.dtype), k.to(v.dtype)
    if BlockMask is not None and isinstance(mask, BlockMask):
        if q.is_cuda and _compiled_flex is None:
            # Uncompiled flex_attention materialises the full score matrix; compiling fuses it.
            _allow_recompiles(FLEX_RECOMPILES)
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        flex = _compiled_flex if q.is_cuda else flex_attention
        return flex(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    B, H, Lq, D = q.shape
    groups = H // k.shape[1]
    # GQA without copying keys/values: the `groups` query heads that share a KV head become extra
    # query rows of that head (heads are grouped consecutively, as in repeat_interleave)
    q = q.reshape(B, H // groups, groups * Lq, D)
    if mask.dtype != torch.bool and groups * Lq <= DECODE_ROWS and B * k.shape[1] < DECODE_PAIRS:
        # A small decoding step: few query rows and pairs against the whole cache, where SDPA with
        # an additive mask leaves most SMs idle (`python -m dice.bench profile` times both). The
        # scores [B, Hkv, rows, Lk] are small, so they are kept in float32 as SDPA keeps them: a
        # bf16 product would round each score before the softmax. On CUDA, cuBLAS writes a half
        # product's float32 accumulator directly, which spares a float32 copy of the keys.
        if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            scores = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(-1, -2), out_dtype=torch.float32)
            scores = scores.unflatten(0, (B, -1))
        else:
            acc = torch.promote_types(q.dtype, torch.float32)
            scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2))
        scores = scores * D ** -0.5 + mask
        return torch.matmul(scores.softmax(-1).to(v.dtype), v).reshape(B, H, Lq, D)
    if mask.dtype == torch.bool and groups > 1:
        mask = mask.expand(*mask.shape[:-3], 1, Lq, mask.shape[-1]).unsqueeze(-3)
        mask = mask.expand(*mask.shape[:-3], groups, Lq, mask.shape[-1]).flatten(-3, -2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(B, H, Lq, D)


def _allow_recompiles(limit: int) -> None:
    """Raise dynamo's per-function recompile limit to at least `limit` (its name since torch 2.6:
    recompile_limit; before: cache_size_limit)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))


def folded_attention_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """A bool [B, 1, Lq, Lk] mask as the additive bias (0 / -inf) that `attend` uses for GQA with
    `groups` query heads per KV head: [B, 1, groups * Lq, Lk], row g * Lq + t for query t of group g,
    as the folded query rows are laid out. Every row must keep a visible key (else NaN)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(1, 1, groups, 1)


def write_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write new [B, Hkv, T, D] keys/values into one layer's cache buffers at `slots` [T]; return
    the first `kv_len` slots' keys/values to attend over."""
    k_buf.index_copy_(2, slots, k)
    v_buf.index_copy_(2, slots, v)
    return k_buf[:, :, :kv_len], v_buf[:, :, :kv_len]


class KVCache:
    """Preallocated keys/values of every layer for a batch of sequences (DESIGN.md §5).

    Slots [0, length) are committed; a forward over T new tokens writes their keys/values at
    slots [length, length + T) and commits the first `commit` of them. Uncommitted slots are
    scratch: the next forward overwrites them, which is how a block is run against the cache
    "without storing it". `valid[b, j]` marks committed slots that hold real tokens (left padding
    of batched prompts is False), so padding is never attended.

    Writes go through a device tensor of slot indices and attention may span a fixed `kv_len`
    (a fixed prefix of the buffer), so the same code runs eagerly and inside a captured CUDA graph. Each layer
    owns its own buffers, so that a `torch.compile`d step writes them in place (a write into a view
    of one shared buffer makes the compiler copy the whole buffer back every step).
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, max_len: int,
                 *, dtype: torch.dtype, device: torch.device | str):
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} + {new_tokens} tokens > max_len "
                             f"{self.max_len}; allocate a larger cache")

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's key and value buffers [B, Hkv, max_len, D]."""
        return self.k[i], self.v[i]

    def attention_mask(self, slots: torch.Tensor, position_ids: torch.Tensor, new_valid: torch.Tensor,
                       block_size: int, kv_len: int) -> torch.Tensor:
        """[B, 1, T, kv_len] mask for T new tokens at the contiguous `slots` [T]: committed valid
        keys, plus the new tokens under the block-causal rule. Every token sees itself, so no row
        is empty (padding rows would otherwise produce NaN that could leak through 0 * NaN)."""
        B, T = position_ids.shape
        eye = torch.eye(T, dtype=torch.bool, device=position_ids.device)
        new = (block_causal_mask(position_ids, block_size) & new_valid[:, None, :]) | eye
        rel = torch.arange(kv_len, device=slots.device) - slots[0]     # key slot -> index among the new
        in_new = (rel >= 0) & (rel < T)
        new_keys = new.index_select(2, rel.clamp(0, T - 1)) & in_new
        return (self.valid[:, None, :kv_len] | new_keys).unsqueeze(1)

    def commit(self, new_valid: torch.Tensor, commit: int) -> None:
        self.valid[:, self.length:self.length + commit] = new_valid[:, :commit]
        self.length += commit

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished sequences from the batch (rows: indices to keep). One layer at a time, so
        that each old buffer is freed before the next is copied: the peak is the cache plus one
        layer's kept rows, not two caches (which would size the largest rollout batch)."""
        for i in range(len(self.k)):
            self.k[i] = self.k[i][rows]
            self.v[i] = self.v[i][rows]
        self.valid = self.valid[rows]
