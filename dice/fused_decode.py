"""The batch-1 decoding step as one persistent Triton kernel (DESIGN.md §5; issue #3).

At batch 1 a block step reads every weight once to compute 4-8 rows, so its speed is the weight
bytes over the memory bandwidth, plus whatever the ~500 separate kernels of the layer-by-layer
forward waste in launches, ramp-up and tails (README, Performance). Here one kernel runs the
whole forward: one program per SM, walking through the phases

    per layer l:  QKV   qkv = rmsnorm(h) W_qkv^T                              (input_layernorm)
                  ATTN  q, k = rope(rmsnorm_head(q, k)); write k, v at the new slots;
                        o = softmax(q k^T / sqrt(d) + mask) v, split over (KV head, key chunk)
                  O     h += o W_o^T
                  UP    a = silu(g) * u,  [g; u] = rmsnorm(h) W_gate_up^T   (post_attention_layernorm)
                  DOWN  h += a W_down^T
    then          LM    logits = rmsnorm(h) W_lm^T                           (model.norm)

with a grid-wide barrier between phases (every program counts into one integer, then waits until
all have). Each matrix phase splits the weight's rows into tiles of BN rows; a program streams its
tiles' rows through a pipelined loop with the 16-row activation block as the other operand of a
tensor-core product. Attention splits the keys of each KV head into chunks of CH, one (head,
chunk) per program, and the last program of a head to finish (an atomic ticket) merges the chunks'
partial softmaxes (flash-decoding).

Numerics follow the layer-by-layer bf16 model: activations are rounded to the weights' dtype where
it rounds them (norm outputs, products, residual sums, RoPE terms). Accumulation order differs, so
bf16 logits differ in the last bits; in float32 they agree to ~1e-6.

Scope: one sequence (batch 1, no padding: a key slot's position is its index), up to 16 new tokens
per forward, Qwen3/SDAR layers. `per_phase=True` launches each phase as its own grid instead of
one persistent kernel (no barrier; for tests, and for Triton's CPU interpreter).
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

ROWS = 16          # new tokens per forward, at most (the activation block's rows)
CHUNK = 32         # keys per attention work item (default; 32 and 64 measured best on an H200)
PHASES = 5         # per layer: QKV, ATTN, O, UP, DOWN; then one LM phase
_TABLE = ("ln1", "qkv", "q_norm", "k_norm", "o", "ln2", "gate_up", "down", "k_cache", "v_cache")


@triton.jit
def _ptr(entry, like):
    """A weight's address from the per-layer pointer table, typed like `like`. Torch allocations
    are 16-byte aligned; saying so lets the loads through it be 16-byte vector loads."""
    return tl.multiple_of(tl.load(entry).to(like.dtype), 16)


@triton.jit
def _grid_barrier(bar, target):
    """Wait until `target` arrivals are counted at `bar` (one per program per barrier so far)."""
    tl.debug_barrier()      # every thread's stores precede this program's release
    tl.atomic_add(bar, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _barrier_kernel(bar, n):
    """n grid barriers in a row and nothing else (`python -m dice.bench fused` times them)."""
    nprog = tl.num_programs(0)
    for i in range(n):
        _grid_barrier(bar, (i + 1) * nprog)


@triton.jit
def _row_rstd(x, T, K, eps, ROWS: tl.constexpr, BK: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each of the T rows of x [ROWS, K] (RMSNorm's scale)."""
    rows = tl.arange(0, ROWS)
    ss = tl.zeros([ROWS], tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        v = tl.load(x + rows[:, None] * K + cols[None, :], mask=rows[:, None] < T, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        ss += tl.sum(v * v, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _matvec(x, T, K, w, n, rstd, nw, NORM: tl.constexpr, GATED: tl.constexpr, N: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr, PREC: tl.constexpr):
    """acc[BN, ROWS] = W[n, :] x^T for weight rows n, x [ROWS, K] (rows >= T are zero); with NORM,
    x is first RMSNorm-ed (x * rstd, rounded, times the norm weight nw, rounded, as RMSNorm does).
    GATED also returns the product with rows n + N (the `up` half of a stacked gate/up matrix)."""
    rows = tl.arange(0, ROWS)
    acc = tl.zeros([BN, ROWS], tl.float32)
    acc2 = tl.zeros([BN, ROWS], tl.float32)
    w_rows = w + n[:, None].to(tl.int64) * K
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        cols = k0 + tl.arange(0, BK)
        wt = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
        xt = tl.load(x + rows[None, :] * K + cols[:, None], mask=rows[None, :] < T, other=0.0, cache_modifier=".cg")
        if NORM:
            xt = (xt.to(tl.float32) * rstd[None, :]).to(wt.dtype).to(tl.float32)
            xt = xt * tl.load(nw + cols).to(tl.float32)[:, None]
        xt = xt.to(wt.dtype)
        acc = tl.dot(wt, xt, acc, input_precision=PREC)
        if GATED:
            wu = tl.load(w_rows + N * K + cols[None, :], eviction_policy="evict_first")
            acc2 = tl.dot(wu, xt, acc2, input_precision=PREC)
    return acc, acc2


@triton.jit
def _linear(x, T, lf, K, w, nw, out, eps, pid, nprog, NORM: tl.constexpr, EPI: tl.constexpr, N: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr, PREC: tl.constexpr):
    """One matrix phase, out [ROWS, N] from x [ROWS, K] and W [N, K] (or [2N, K] when EPI == 2).
    EPI 0: out = y;  1: out += y (residual);  2: out = silu(y_gate) * y_up;  3: logits rows lf..T-1."""
    rows = tl.arange(0, ROWS)
    if NORM:
        rstd = _row_rstd(x, T, K, eps, ROWS, BK)
    else:
        rstd = tl.full([ROWS], 1.0, tl.float32)
    dt = out.dtype.element_ty
    for tile in range(pid, N // BN, nprog):
        n = tile * BN + tl.arange(0, BN)
        acc, acc2 = _matvec(x, T, K, w, n, rstd, nw, NORM, EPI == 2, N, BN, BK, ROWS, STAGES, PREC)
        dst = out + rows[None, :] * N + n[:, None]
        keep = rows[None, :] < T
        y = acc.to(dt)
        if EPI == 1:
            old = tl.load(dst, mask=keep, other=0.0, cache_modifier=".cg")
            y = (old.to(tl.float32) + y.to(tl.float32)).to(dt)
        if EPI == 2:
            g = y.to(tl.float32)
            y = ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * acc2.to(dt).to(tl.float32)).to(dt)
        if EPI == 3:
            dst = out + (rows[None, :] - lf) * N + n[:, None]
            keep = keep & (rows[None, :] >= lf)
        tl.store(dst, y, mask=keep)


@triton.jit
def _norm_rope(row, ok, t, w, cos, sin, eps, D: tl.constexpr):
    """RMSNorm over one head's D values per row, then rotate-half RoPE at token t's angles.
    row: [R, 1] pointers to each row's head; ok: [R, 1] rows to load."""
    dt = row.dtype.element_ty
    d = tl.arange(0, D)
    half = (d + D // 2) % D
    x = tl.load(row + d[None, :], mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    xh = tl.load(row + half[None, :], mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    x = ((x * rstd[:, None]).to(dt).to(tl.float32) * tl.load(w + d).to(tl.float32)[None, :]).to(dt).to(tl.float32)
    xh = ((xh * rstd[:, None]).to(dt).to(tl.float32) * tl.load(w + half).to(tl.float32)[None, :]).to(dt)
    xh = tl.where(d[None, :] < D // 2, -xh.to(tl.float32), xh.to(tl.float32))
    c = tl.load(cos + t[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin + t[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    return ((x * c).to(dt).to(tl.float32) + (xh * s).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _attention(qkv, att, part_o, part_ml, tickets, kc, vc, qn, kn, cos, sin, length, T, max_len, eps, scale,
               pid, nprog, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
               CH: tl.constexpr, MAXC: tl.constexpr, ROWS: tl.constexpr, PREC: tl.constexpr):
    """Attention of the T new tokens over the cache's `length` committed keys plus themselves
    (block-causal among the new ones on the absolute grid). Work item (KV head g, chunk c): chunks
    c < n_old hold committed keys, chunk n_old the new tokens, whose k/v it also writes to the cache.
    Rows r of a work item are the folded GQA queries: query head g * G + r // ROWS, token r % ROWS."""
    G: tl.constexpr = H // HKV
    NQKV: tl.constexpr = (H + 2 * HKV) * D
    dt = qkv.dtype.element_ty
    r = tl.arange(0, G * ROWS)
    t = r % ROWS
    d = tl.arange(0, D)
    j = tl.arange(0, CH)
    n_old = tl.cdiv(length, CH)
    n_chunks = n_old + 1
    for item in range(pid, HKV * n_chunks, nprog):
        g = item % HKV
        c = item // HKV
        heads = g * G + r // ROWS
        q = _norm_rope(qkv + t[:, None] * NQKV + heads[:, None] * D, t[:, None] < T, t, qn, cos, sin, eps, D)
        kv_rows = kc + g * max_len * D
        if c < n_old:
            slot = c * CH + j
            visible = (slot < length)[None, :] & (r >= 0)[:, None]
            k = tl.load(kv_rows + slot[:, None] * D + d[None, :], mask=(slot < length)[:, None], other=0.0)
            v = tl.load(vc + g * max_len * D + slot[:, None] * D + d[None, :], mask=(slot < length)[:, None],
                        other=0.0)
        else:
            new = (j < T)[:, None]
            k = _norm_rope(qkv + j[:, None] * NQKV + (H + g) * D, new, j, kn, cos, sin, eps, D)
            v = tl.load(qkv + j[:, None] * NQKV + (H + HKV + g) * D + d[None, :], mask=new, other=0.0,
                        cache_modifier=".cg")
            tl.store(kv_rows + (length + j)[:, None] * D + d[None, :], k, mask=new)
            tl.store(vc + g * max_len * D + (length + j)[:, None] * D + d[None, :], v, mask=new)
            visible = (j < T)[None, :] & ((length + j)[None, :] // BS <= (length + t)[:, None] // BS)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        s = tl.where(visible, s, float("-inf"))
        m = tl.max(s, axis=1)
        p = tl.exp(s - m[:, None])
        o = tl.dot(p.to(dt), v, input_precision=PREC)
        part = (g * MAXC + c) * (G * ROWS)
        tl.store(part_o + (part + r)[:, None] * D + d[None, :], o)
        tl.store(part_ml + 2 * part + r, m)
        tl.store(part_ml + 2 * part + G * ROWS + r, tl.sum(p, axis=1))
        tl.debug_barrier()   # the partials of every thread precede the ticket's release
        if tl.atomic_add(tickets + g, 1, sem="acq_rel", scope="gpu") == n_chunks - 1:
            # the head's last chunk: merge the partial softmaxes in chunk order
            m_all = tl.full([G * ROWS], float("-inf"), tl.float32)
            for cc in range(0, n_chunks):
                pc = (g * MAXC + cc) * (G * ROWS)
                m_all = tl.maximum(m_all, tl.load(part_ml + 2 * pc + r, cache_modifier=".cg"))
            acc = tl.zeros([G * ROWS, D], tl.float32)
            total = tl.zeros([G * ROWS], tl.float32)
            for cc in tl.range(0, n_chunks, num_stages=3):
                pc = (g * MAXC + cc) * (G * ROWS)
                wgt = tl.exp(tl.load(part_ml + 2 * pc + r, cache_modifier=".cg") - m_all)
                total += wgt * tl.load(part_ml + 2 * pc + G * ROWS + r, cache_modifier=".cg")
                acc += wgt[:, None] * tl.load(part_o + (pc + r)[:, None] * D + d[None, :], cache_modifier=".cg")
            tl.store(att + t[:, None] * (H * D) + heads[:, None] * D + d[None, :], (acc / total[:, None]).to(dt),
                     mask=t[:, None] < T)


@triton.jit(do_not_specialize=["T", "lf", "phase_lo", "phase_hi"])
def _decoder_kernel(table, h, qkv, att, act, part_o, part_ml, tickets, bar, cos, sin, start, final_norm, lm_w,
                    logits, T, lf, phase_lo, phase_hi, max_len, eps, scale,
                    LAYERS: tl.constexpr, HID: tl.constexpr, INTER: tl.constexpr, VOCAB: tl.constexpr,
                    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, CH: tl.constexpr,
                    MAXC: tl.constexpr, ROWS: tl.constexpr, TOK: tl.constexpr, STAGES: tl.constexpr,
                    PREC: tl.constexpr,
                    BN_QKV: tl.constexpr, BK_QKV: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
                    BN_UP: tl.constexpr, BK_UP: tl.constexpr, BN_DOWN: tl.constexpr, BK_DOWN: tl.constexpr,
                    BN_LM: tl.constexpr, BK_LM: tl.constexpr, PHASES: tl.constexpr):
    """Phases [phase_lo, phase_hi) of the forward (module docstring), a grid barrier between two."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    length = tl.load(start)
    NT: tl.constexpr = 10
    for p in range(phase_lo, phase_hi):
        layer = p // PHASES
        kind = p % PHASES
        row = table + layer * NT
        if layer == LAYERS:
            _linear(h, T, lf, HID, lm_w, final_norm, logits, eps, pid, nprog, True, 3, VOCAB, BN_LM, BK_LM,
                    ROWS, STAGES, PREC)
        elif kind == 0:
            _linear(h, T, lf, HID, _ptr(row + 1, h), _ptr(row + 0, h), qkv, eps, pid, nprog, True, 0,
                    (H + 2 * HKV) * D, BN_QKV, BK_QKV, ROWS, STAGES, PREC)
        elif kind == 1:
            _attention(qkv, att, part_o, part_ml, tickets + layer * HKV, _ptr(row + 8, h), _ptr(row + 9, h),
                       _ptr(row + 2, h), _ptr(row + 3, h), cos, sin, length, T, max_len, eps, scale, pid, nprog,
                       H, HKV, D, BS, CH, MAXC, TOK, PREC)
        elif kind == 2:
            _linear(att, T, lf, H * D, _ptr(row + 4, h), h, h, eps, pid, nprog, False, 1, HID, BN_O, BK_O,
                    ROWS, STAGES, PREC)
        elif kind == 3:
            _linear(h, T, lf, HID, _ptr(row + 6, h), _ptr(row + 5, h), act, eps, pid, nprog, True, 2, INTER,
                    BN_UP, BK_UP, ROWS, STAGES, PREC)
        else:
            _linear(act, T, lf, INTER, _ptr(row + 7, h), h, h, eps, pid, nprog, False, 1, HID, BN_DOWN,
                    BK_DOWN, ROWS, STAGES, PREC)
        if p + 1 < phase_hi:
            _grid_barrier(bar, (p + 1 - phase_lo) * nprog)


def _tile(n: int, k: int, programs: int, itemsize: int) -> tuple[int, int]:
    """(BN, BK) for an [n, k] weight: the BN in {64, 32, 16} that gives the fewest rows to the
    busiest program (ties: larger tiles), and BK so that a weight tile is 16 KB."""
    if n % 16:
        raise ValueError(f"fused decoding needs weight row counts divisible by 16; got {n}")
    # measured on an H200: 32-row tiles stream best unless that leaves over half the programs idle;
    # many tiles per program (lm_head) prefer 64 rows
    bn = 64 if n % 64 == 0 and n // 64 >= 8 * programs else 32 if n % 32 == 0 and n // 32 >= programs // 2 else 16
    bk = min(k, 16384 // itemsize // bn)
    if k % bk:
        raise ValueError(f"fused decoding needs a reduction size divisible by {bk}; got {k}")
    return bn, bk


class FusedDecoder:
    """A batch-1 decoding step of `model` against `cache` as one kernel: `step_logits(...)` has the
    signature and results of `SDAR.step_logits` for one sequence. It keeps pointers to the model's
    weights and the cache's buffers: build it after both exist and drop it when either changes.

    programs: the persistent grid (default: one program per SM); stages / warps: the Triton
    pipelining depth and warps per program.
    """

    def __init__(self, model, cache, *, programs: int | None = None, stages: int = 3, warps: int = 4,
                 chunk: int = CHUNK, tiles: dict | None = None):
        c = model.config
        w = model.lm_head.weight
        if cache.k[0].shape[0] != 1:
            raise ValueError(f"fused decoding runs one sequence; the cache holds {cache.k[0].shape[0]}")
        if c.num_attention_heads % c.num_key_value_heads or c.head_dim & (c.head_dim - 1):
            raise ValueError("fused decoding needs whole GQA groups and a power-of-two head_dim")
        if 2 * c.block_size > ROWS:
            raise ValueError(f"fused decoding runs at most {ROWS} tokens per forward: block_size <= {ROWS // 2}")
        # attention rows per query head: enough for a step (a block plus the block it commits), and
        # at least 16 folded rows in all (the tensor-core minimum); fewer rows spare registers
        groups = c.num_attention_heads // c.num_key_value_heads
        self.tokens = max(8 if 2 * c.block_size <= 8 else ROWS, -(-16 // groups))
        self.model, self.cache, self.cfg = model, cache, c
        dev, dt = w.device, w.dtype
        if programs is None:
            programs = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        self.programs, self.stages, self.warps = programs, stages, warps
        layers = model.model.layers
        ptrs = []
        for i, layer in enumerate(layers):
            a, m = layer.self_attn, layer.mlp
            tensors = (layer.input_layernorm.weight, a.qkv_proj.weight, a.q_norm.weight, a.k_norm.weight,
                       a.o_proj.weight, layer.post_attention_layernorm.weight, m.gate_up_proj.weight,
                       m.down_proj.weight, cache.k[i], cache.v[i])
            if any(x.dtype != dt or not x.is_contiguous() for x in tensors):
                raise ValueError("fused decoding needs contiguous weights and cache of one dtype")
            ptrs.append([x.data_ptr() for x in tensors])
        self.table = torch.tensor(ptrs, dtype=torch.int64, device=dev)
        hid, inter, H, hkv, D = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        nqkv = (H + 2 * hkv) * D
        self.max_chunks = -(-cache.max_len // chunk) + 1
        zeros = lambda *shape, dtype=dt: torch.zeros(shape, dtype=dtype, device=dev)  # noqa: E731
        self.h, self.qkv, self.att, self.act = zeros(ROWS, hid), zeros(ROWS, nqkv), zeros(ROWS, H * D), zeros(ROWS, inter)
        self.cos, self.sin = zeros(ROWS, D), zeros(ROWS, D)
        rows = (H // hkv) * ROWS
        self.part_o = zeros(hkv * self.max_chunks * rows, D, dtype=torch.float32)
        self.part_ml = zeros(hkv * self.max_chunks * 2 * rows, dtype=torch.float32)
        self.counters = zeros(1 + c.num_hidden_layers * hkv, dtype=torch.int32)   # barrier, then tickets
        self.logits = zeros(ROWS, c.vocab_size)
        tiles, self_tiles = {}, dict(tiles or {})
        for name, (n, k) in dict(QKV=(nqkv, hid), O=(hid, H * D), UP=(inter, hid), DOWN=(hid, inter),
                                 LM=(c.vocab_size, hid)).items():
            tiles[f"BN_{name}"], tiles[f"BK_{name}"] = _tile(n, k, programs, w.element_size())
        tiles.update(self_tiles)
        self.constants = dict(LAYERS=c.num_hidden_layers, HID=hid, INTER=inter, VOCAB=c.vocab_size, H=H, HKV=hkv,
                              D=D, BS=c.block_size, CH=chunk, MAXC=self.max_chunks, ROWS=ROWS, TOK=self.tokens,
                              PREC="ieee" if dt == torch.float32 else "tf32", PHASES=PHASES, **tiles)

    def step_logits(self, input_ids, position_ids, valid, cache, slots, kv_len, logits_from=0, run_layer=None,
                    *, per_phase: bool = False) -> torch.Tensor:
        """Logits [1, T - logits_from, V] of T new tokens written at `slots` (contiguous, from the
        cache's filled length); attention spans the committed keys and the new ones (`kv_len` and
        `valid` are implied at batch 1 and unused; `run_layer` does not apply)."""
        from .model import rope_cos_sin
        if cache is not self.cache:
            raise ValueError("this FusedDecoder was built for another cache")
        T = input_ids.shape[1]
        if input_ids.shape[0] != 1 or T > self.tokens:
            raise ValueError(f"fused decoding runs 1 sequence of at most {self.tokens} tokens; got {tuple(input_ids.shape)}")
        c = self.cfg
        self.h[:T] = self.model.model.embed_tokens(input_ids[0])
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, self.h.dtype)
        self.cos[:T], self.sin[:T] = cos[0, 0], sin[0, 0]
        self.counters.zero_()
        last = PHASES * c.num_hidden_layers + 1
        spans = [(p, p + 1) for p in range(last)] if per_phase else [(0, last)]
        for lo, hi in spans:
            _decoder_kernel[(self.programs,)](
                self.table, self.h, self.qkv, self.att, self.act, self.part_o, self.part_ml, self.counters[1:],
                self.counters, self.cos, self.sin, slots, self.model.model.norm.weight, self.model.lm_head.weight,
                self.logits, T, logits_from, lo, hi, cache.max_len, c.rms_norm_eps, c.head_dim ** -0.5,
                num_warps=self.warps, num_stages=1, STAGES=self.stages, **self.constants)
        return self.logits[:T - logits_from].unsqueeze(0)


def _profile_launches() -> None:
    """`python -m dice.fused_decode` (CUDA): a random SDAR-1.7B step against 1024 cached tokens,
    launched as three kernels for Nsight Compute: the first layer's gate/up phase alone, its
    attention phase alone, then one persistent forward. Profile with
    `ncu --clock-control none -k regex:_decoder_kernel python -m dice.fused_decode`."""
    from .bench import random_model
    torch.manual_seed(0)
    model = random_model("1.7b")
    c = model.config
    n = 1024
    ids = torch.randint(0, 150000, (1, n + 4), device="cuda")
    pos = torch.arange(n + 4, device="cuda")[None]
    cache = model.new_cache(1, n + 16)
    with torch.inference_mode():
        model.forward_cached(ids[:, :n], pos[:, :n], cache, commit=n)
        dec = FusedDecoder(model, cache)
        slots = torch.arange(n, n + 4, device="cuda")
        dec.step_logits(ids[:, n:], pos[:, n:], None, cache, slots, n + 4)    # compiles; fills the scratch
        for lo, hi in ((3, 4), (1, 2), (0, PHASES * c.num_hidden_layers + 1)):
            dec.counters.zero_()
            _decoder_kernel[(dec.programs,)](
                dec.table, dec.h, dec.qkv, dec.att, dec.act, dec.part_o, dec.part_ml, dec.counters[1:], dec.counters,
                dec.cos, dec.sin, slots, model.model.norm.weight, model.lm_head.weight, dec.logits, 4, 0, lo, hi,
                cache.max_len, c.rms_norm_eps, c.head_dim ** -0.5, num_warps=dec.warps, num_stages=1,
                STAGES=dec.stages, **dec.constants)
        torch.cuda.synchronize()


if __name__ == "__main__":
    _profile_launches()
