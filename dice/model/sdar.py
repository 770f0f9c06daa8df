"""The SDAR / DICE block-diffusion transformer: Qwen3 layers with block-diffusion attention (DESIGN.md §2).

    h = embed(x)
    for each layer:  h += o_proj(attn(rmsnorm(h)))          attn: q/k RMSNorm per head, RoPE, GQA
                     h += down(silu(gate(g)) * up(g)),  g = rmsnorm(h)
    logits = lm_head(rmsnorm(h))                            NOT shifted: logits[i] predicts token i

Tensor names equal Hugging Face Qwen3's, except that q/k/v and gate/up are each one stacked
matrix (`qkv_proj`, `gate_up_proj`): at decoding batch sizes a forward is one matrix-vector
product per weight, and fewer, larger products read the weights closer to HBM speed.
`dice.model.checkpoint` maps the stacked tensors to and from the published layout, so public SDAR/DICE
checkpoints load as published. The mask passed to `forward` decides the attention pattern; `None`
means the block-causal inference mask on the absolute grid.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from .attention import KVCache, attend, block_causal_mask, folded_attention_bias, write_kv


@dataclass
class ModelConfig:
    """The architecture keys of an SDAR `config.json`; unknown keys are kept in `extra` so that
    a saved checkpoint keeps the published layout."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mask_token_id: int
    block_size: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        d = dict(d)
        if d.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
            # a wrong type or a zero head count is left to `dice.model.checkpoint.config_problem` to name
            sizes = (d["hidden_size"], d["num_attention_heads"])
            d["head_dim"] = sizes[0] // sizes[1] if all(type(v) is int and v > 0 for v in sizes) else None
        if d.get("num_key_value_heads") is None and "num_attention_heads" in d:
            d["num_key_value_heads"] = d["num_attention_heads"]
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name in names and f.default is dataclasses.MISSING and f.name not in d]
        if missing:
            raise KeyError(", ".join(missing))
        known = {k: v for k, v in d.items() if k in names}
        return cls(**known, extra={k: v for k, v in d.items() if k not in names})

    def to_dict(self) -> dict:
        d = dict(self.extra)
        d.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        d.setdefault("model_type", "sdar")
        d.setdefault("architectures", ["SDARForCausalLM"])
        return d

    def num_parameters(self, include_embedding: bool = True) -> int:
        h, L = self.hidden_size, self.num_hidden_layers
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h + 2 * self.head_dim
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + h + (emb if include_embedding else 0)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 like the reference (float64 stays float64)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is one fused kernel where torch has it; decoding runs ~110 norms per forward
        normed = F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [B, 1, L, D] of rotate-half RoPE: angle(p, i) = p * theta^(-2i/D), i < D/2, repeated."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_split = [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.qkv_split), bias=False)  # [q_proj; k_proj; v_proj]
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv: tuple | None = None, slots=None, kv_len=0):
        """kv: this layer's cache buffers (`KVCache.layer`): the new keys/values are written at
        `slots` and attention spans the buffers' first `kv_len` slots."""
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        q = self.q_norm(q.reshape(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.reshape(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = v.reshape(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            k, v = write_kv(*kv, k, v, slots, kv_len)
        y = attend(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # [gate; up]
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, mask, kv=None, slots=None, kv_len=0):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, kv, slots, kv_len)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """Named `model` inside `SDAR` so tensor names read `model.layers.N...` as in the checkpoints."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def compute_device(model: nn.Module) -> torch.device:
    """The device `model` computes on: where its parameters are, or, for a model whose float32
    state FSDP2 keeps in host memory between uses (`dice.runtime.shard` with offload), the device
    it was sharded for (`model.compute_device`)."""
    return getattr(model, "compute_device", None) or next(model.parameters()).device


class SDAR(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.gradient_checkpointing = False

    def tie_weights(self) -> "SDAR":
        """lm_head shares the embedding when `tie_word_embeddings`; re-run after `to_empty`,
        which gives every module its own new tensor."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        return self

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> "SDAR":
        """Random init for training from scratch: N(0, std) matrices, unit norms. Drawn on the
        parameters' device with a generator seeded by `seed`."""
        device = self.lm_head.weight.device
        gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
        return self

    def hidden_states(self, input_ids, position_ids=None, attention_mask=None) -> torch.Tensor:
        """Final-normed hidden states [B, L, hidden]; see `forward` for the arguments."""
        B, L = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
        if attention_mask is None:
            attention_mask = block_causal_mask(torch.arange(L, device=input_ids.device), self.config.block_size)
        elif isinstance(attention_mask, torch.Tensor):
            if attention_mask.dtype != torch.bool or attention_mask.dim() not in (2, 3) \
                    or attention_mask.shape[-2:] != (L, L):
                raise ValueError(f"attention_mask must be a bool tensor of shape [L, L] or [B, L, L] with "
                                 f"L = {L}; got {attention_mask.dtype} {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.unsqueeze(-3)  # broadcast over heads
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, h.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training:
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, attention_mask, use_reentrant=False)
            else:
                h = layer(h, cos, sin, attention_mask)
        return self.model.norm(h)

    def forward(self, input_ids, position_ids=None, attention_mask=None, logits_at=None) -> torch.Tensor:
        """Logits [B, L, V] (unshifted).

        input_ids: [B, L]; position_ids: [B, L] (default 0..L-1); attention_mask: bool [L, L] or
        [B, L, L] with True = may attend, a FlexAttention BlockMask, or None for the block-causal
        mask with blocks of `config.block_size` counted from index 0. logits_at: optional [B, L]
        bool; then only the logits of those positions are computed, [N, V] (training needs the
        logits of the masked tokens alone).
        """
        h = self.hidden_states(input_ids, position_ids, attention_mask)
        return self.lm_head(h if logits_at is None else h[logits_at])

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.lm_head.weight
        c = self.config
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, c.head_dim, max_len,
                       dtype=p.dtype, device=p.device)

    def forward_cached(self, input_ids, position_ids, cache: KVCache, *, commit: int,
                       valid: torch.Tensor | None = None, logits_from: int = 0, kv_len: int | None = None,
                       run_layer=None) -> torch.Tensor:
        """Run T new tokens against the KV cache (DESIGN.md §5).

        The new tokens see every committed valid key and each other under the block-causal rule
        on `position_ids`. Their keys/values are written to the cache; the first `commit` of them
        become part of it (prefill: commit=T; a denoising step: commit=0; a finished block:
        commit=block_size). valid: [B, T] False for left padding. Returns logits of new tokens
        [logits_from:]. kv_len (default: the filled length) and run_layer: see `step_logits`.
        """
        B, T = input_ids.shape
        cache.check_room(T)
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
        slots = torch.arange(cache.length, cache.length + T, device=input_ids.device)
        logits = self.step_logits(input_ids, position_ids, valid, cache, slots, kv_len or cache.length + T,
                                  logits_from, run_layer)
        cache.commit(valid, commit)
        return logits

    def step_logits(self, input_ids, position_ids, valid, cache: KVCache, slots: torch.Tensor, kv_len: int,
                    logits_from: int = 0, run_layer=None) -> torch.Tensor:
        """The body of `forward_cached` without the host-side commit: every shape is fixed by
        (B, T, kv_len) and the write position is the device tensor `slots`, so a CUDA graph can
        capture it (`dice.sampling.sampler` does). run_layer(layer, h, cos, sin, mask, kv, slots, kv_len)
        replaces `layer(...)`, e.g. by one `torch.compile`d function that serves every layer."""
        h = self.model.embed_tokens(input_ids)
        c = self.config
        mask = cache.attention_mask(slots, position_ids, valid, c.block_size, kv_len)
        # once per forward, not in each of the layers: the layout SDPA takes for folded GQA rows
        mask = folded_attention_bias(mask, c.num_attention_heads // c.num_key_value_heads, h.dtype)
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, h.dtype)
        for i, layer in enumerate(self.model.layers):
            args = (h, cos, sin, mask, cache.layer(i), slots, kv_len)
            h = layer(*args) if run_layer is None else run_layer(layer, *args)
        return self.lm_head(self.model.norm(h[:, logits_from:]))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6 * matmul params
    + 12 * layers * heads * head_dim * seq_len for attention scores and values (dense, unmasked)."""
    matmul = cfg.num_parameters(include_embedding=False) + cfg.vocab_size * cfg.hidden_size
    return 6 * matmul + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len


SDAR_SHAPES = {
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
}


def sdar_shape(name: str, **overrides) -> ModelConfig:
    """Configs of the public SDAR sizes (random-weight benchmarks and tests)."""
    base = dict(vocab_size=151936, head_dim=128, mask_token_id=151669, block_size=4, rms_norm_eps=1e-6,
                rope_theta=1e6, max_position_embeddings=32768)
    return ModelConfig(**{**base, **SDAR_SHAPES[name.lower()], **overrides})


def random_model(shape: str, device="cuda", dtype=torch.bfloat16, seed: int = 0, peaked: float = 1.0, **overrides):
    """A random-weight SDAR of a public shape; `peaked` scales lm_head so that outputs are confident."""
    with torch.device("meta"):
        model = SDAR(sdar_shape(shape, **overrides))
    model = model.to_empty(device=device).tie_weights().float().init_weights(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(peaked)
    return model.to(dtype).eval()
