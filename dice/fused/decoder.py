"""The batch-1 decoding step as one persistent CUDA kernel (DESIGN.md §5; issue #3).

At batch 1 a block step reads every weight once to compute 4-8 rows, so its speed is the weight
bytes over the memory bandwidth. The layer-by-layer forward runs ~500 kernels, and each matrix
product pays launch, ramp-up and tail on top of its bytes: 54% of the roofline at most (README,
Performance). Here one kernel (`fused_decode.cu`, compiled by CuPy's NVRTC) runs the forward with
one block per SM, walking the phases

    first         h = embed[ids]                      (read by the first QKV phase, which writes h)
    per layer l:  QKV   qkv = rmsnorm(h) W_qkv^T                              (input_layernorm)
                  ATTN  q, k = rope(rmsnorm_head(q, k)); write k, v at the new slots;
                        o = softmax(q k^T / sqrt(d) + mask) v, split over (KV head, key chunk)
                  O     h += o W_o^T
                  UP    a = silu(g) * u,  [g; u] = rmsnorm(h) W_gate_up^T   (post_attention_layernorm)
                  DOWN  h += a W_down^T
    then          LM    logits = rmsnorm(h) W_lm^T                           (model.norm)
                        greedy: argmax over the vocabulary (mask token left out), 1 / sum exp(l - max)

with a grid-wide barrier between phases (one counter: a release add, an acquire poll). The point of
the design: weights do not depend on the activations, so a producer thread in every block streams
the block's share of *all* the forward's weights (16-row tiles, dealt round-robin over the blocks,
each cut into KC-wide stages) into a ring of shared-memory stages, one TMA bulk copy per stage,
waiting only for free stages (mbarriers). Eight consumer warps wait at the barriers, run attention
and the norms, and multiply each arriving stage with the activation rows (tensor-core mma.sync
m16n8k16, the weight tile as A, the token rows as B). So HBM keeps streaming the next phase's
weights while the consumers synchronise. A stage is one contiguous copy because FusedDecoder keeps
a tiled copy of every matrix ([N/16][K/kc][16][kc], 16-byte pieces XOR-swizzled against shared-
memory bank conflicts): the weights' memory, twice.

RoPE reads tables of every slot's cos / sin, built once per cache. Attention splits each KV head's
keys into programs / HKV contiguous chunks, one per block (half as many for caches of at most
SHORT_CACHE slots, where the merge of fewer partials saves more than longer chunks cost); the chunk
that holds the new tokens is SLACK slots shorter, as its block also norms and writes their keys. A chunk
passes through shared memory in pieces (online softmax); the first is fetched with cp.async while
the QKV phase runs, and a piece holds the whole chunk while 4 ring stages still fit (for SDAR-1.7B
on an H200, caches up to ~3.8K slots with 4 token rows, ~2.8K with 8), so longer caches take several
pieces, not a shallower ring. Scores (a 16-key tile as A, the query rows as B) and value sums (the
probabilities as A, values transposed by ldmatrix as B) are mma.sync products too; the piece's key
and value rows are XOR-swizzled by 16-byte chunk, so those loads are free of bank conflicts. The
last block of a head to finish (an atomic ticket) merges the partial softmaxes (flash-decoding).
There are two kernels, for up to 4 and up to 8 token rows: 4 rows (most denoising steps) leave
more shared memory for the ring. With greedy=True the LM phase also makes the sampler's greedy
choice (temperature 0): each block reads back the logits it wrote, folds them into a running (max,
first row, sum of exp(l - max)) per token and thread, combines its threads', and the last block to
take a ticket combines the blocks'.

Numerics follow the layer-by-layer bf16 model: activations are rounded to bf16 where it rounds
them (norm outputs, products, residual sums, RoPE terms); attention keeps scores, softmax sums and
value sums in float32, rounds the probabilities to bf16 for the value product (so does the
layer-by-layer decode attention, `dice.model.attention`) and rounds its output. Accumulation order
differs, so logits differ from the layer-by-layer step's in the last bits.

Scope: bf16 weights, one sequence (batch 1, no padding: a key slot's position is its index), up
to 8 new tokens per forward (block_size <= 4), head_dim 32, 64 or 128, Qwen3/SDAR layers, an SM90
GPU (Hopper: TMA bulk copies and mbarriers). `phases=(lo, hi)` runs part of the forward (tests).
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..model.sdar import rope_cos_sin

NT = 8             # token rows per forward, at most (the mma's N)
CW = 8             # consumer warps per block
PHASES = 5         # per layer: QKV, ATTN, O, UP, DOWN; then one LM phase
KC = 512           # weight columns per ring stage (a stage is 16 rows x KC, one bulk copy)
MIN_RING = 4       # ring stages kept when an attention chunk does not fit in shared memory whole
SHORT_CACHE = 2048 # caches up to this many slots split a KV head's keys over half as many chunks
SLACK = 64         # key slots fewer in the attention chunk of the new tokens (it also norms their keys)
_SOURCE = Path(__file__).with_name("fused_decode.cu")


class FusedDecodingError(UserError):
    """A model, cache or GPU the fused step cannot run (the message says why)."""


_KERNELS: dict = {}     # compiled kernels by source


class FusedDecoder:
    """A batch-1 decoding step of `model` against `cache` as one kernel: `step_logits(...)` has the
    signature and results of `SDAR.step_logits` for one sequence. It keeps pointers to the model's
    weights and the cache's buffers: build it after both exist and drop it when either changes.

    programs: blocks (default: one per SM); kc: weight columns per ring stage; stages: ring depth
    (default: as many as fit in shared memory); rows: the kernels' token-row counts (a step of T
    tokens takes the smallest >= T); piece: key slots per piece of an attention chunk (default: as
    many as fit, see `_build`); greedy: the kernel also makes each logit row's greedy choice
    (`greedy_choice`), which spares the sampler at temperature 0 its own pass over the logits;
    slack: key slots that the attention chunk holding the new tokens gets fewer than the others, as
    its block also norms, rotates and writes the new keys (README Performance: 64 measured best).
    """

    def __init__(self, model, cache, *, programs: int | None = None, kc: int = KC, stages: int | None = None,
                 rows: tuple[int, ...] = (4, NT), piece: int | None = None, greedy: bool = False,
                 slack: int = SLACK):
        c = model.config
        w = model.lm_head.weight
        problem = _unsupported(c, w, cache, kc)
        if problem:
            raise FusedDecodingError(f"fused decoding: {problem}")
        try:   # CuPy is optional (the [gpu] extra)
            import cupy
        except ImportError:
            raise RuntimeError("fused decoding compiles its kernel with CuPy: pip install -e '.[gpu]'") from None
        self.model, self.cache, self.cfg, self.cupy = model, cache, c, cupy
        dev = w.device
        self.programs = programs or torch.cuda.get_device_properties(dev).multi_processor_count
        hid, inter, D = c.hidden_size, c.intermediate_size, c.head_dim
        H, hkv = c.num_attention_heads, c.num_key_value_heads
        self.nchunks = chunks_per_head(self.programs, hkv, cache.max_len)
        self.piece, self.slack = piece, slack
        # one kernel per token-row count: 4 rows (most denoising steps) leave more room for the ring
        self.kernels = {r: self._build(r, kc, stages) for r in sorted(rows)}
        if max(self.kernels) < NT:
            raise ValueError(f"fused decoding needs a kernel for {NT} token rows; rows={rows}")
        ptrs, self.tiled = [], []
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            ptrs.append([x.data_ptr() for x in (
                layer.input_layernorm.weight, self._tile(a.qkv_proj.weight, kc), a.q_norm.weight, a.k_norm.weight,
                self._tile(a.o_proj.weight, kc), layer.post_attention_layernorm.weight,
                self._tile(m.gate_up_proj.weight, kc), self._tile(m.down_proj.weight, kc), cache.k[i], cache.v[i])])
        self.lm_tiled = self._tile(w, kc)
        self.table = torch.tensor(ptrs, dtype=torch.int64, device=dev)
        bf = dict(dtype=torch.bfloat16, device=dev)
        self.h, self.qkv = torch.zeros(NT, hid, **bf), torch.zeros(NT, (H + 2 * hkv) * D, **bf)
        self.att, self.act = torch.zeros(NT, H * D, **bf), torch.zeros(NT, inter, **bf)
        # RoPE tables for every slot: at batch 1 a token's position is its slot (rope_cos_sin is
        # elementwise, so a row equals what it gives for that position alone)
        cos, sin = rope_cos_sin(torch.arange(cache.max_len, device=dev)[None], D, c.rope_theta, torch.bfloat16)
        self.cos, self.sin = cos[0, 0].contiguous(), sin[0, 0].contiguous()
        rmax = H // hkv * NT
        self.part_o = torch.zeros(self.nchunks * hkv * rmax, D, dtype=torch.float32, device=dev)
        self.part_ml = torch.zeros(self.nchunks * hkv * 2 * rmax, dtype=torch.float32, device=dev)
        # the grid barrier's, one attention ticket per (layer, KV head), the greedy choice's ticket
        self.counters = torch.zeros(2 + c.num_hidden_layers * hkv, dtype=torch.int32, device=dev)
        self.greedy = greedy
        self.greedy_part = torch.zeros(self.programs * NT * 3, dtype=torch.float32, device=dev)
        self.greedy_tok = torch.zeros(NT, dtype=torch.long, device=dev)
        self.greedy_conf = torch.zeros(NT, dtype=torch.float32, device=dev)
        self.logits = torch.zeros(NT, c.vocab_size, **bf)
        self.all_phases = PHASES * c.num_hidden_layers + 1

    def _build(self, nt: int, kc: int, stages: int | None) -> dict:
        """The kernel for up to `nt` token rows: its shared-memory layout (activations, attention
        scratch, then as many ring stages as fit) and its compilation. An attention piece holds a
        whole chunk when the chunk fits beside MIN_RING stages (the ring's depth hardly matters past
        that, README Performance), else as many slots as fit."""
        c, D = self.cfg, self.cfg.head_dim
        hid, inter, H, hkv = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads
        rmax = H // hkv * nt
        kmax = max(hid, H * D, inter)
        # activations (nt rows of the widest input), and attention's scratch behind the QKV phase's
        # rows (its first keys/values are prefetched while that phase runs): keys and values of a
        # piece of `sub` slots (rounded up to whole 16-key tiles), the new tokens' keys and values,
        # queries, probabilities, scores, running max / sum (or, in the merge, the chunks' weights)
        attn_offset = -(-nt * (hid * 2 + 64) // 128) * 128
        stage = 16 * kc * 2
        room = _max_shared(self.model.lm_head.weight.device) - 256 - 1024 - CW * 2 * 128 * 4   # 256: static

        def scratch_bytes(sub):
            sub16 = -(-sub // 16) * 16
            attn = (2 * 2 * sub16 * D + 2 * 2 * nt * D + 2 * rmax * D + 2 * rmax * sub16
                    + 4 * max(rmax * sub16 + 3 * rmax, 2 * self.nchunks * rmax))
            return -(-max(nt * (kmax * 2 + 64), attn_offset + attn) // 128) * 128
        chunk = -(-(self.cache.max_len + self.slack) // self.nchunks)   # the longest chunk this cache can have
        sub = min(self.piece or chunk, chunk)
        if self.piece is None:
            while sub > 16 and room - scratch_bytes(sub) < MIN_RING * stage:
                sub -= 1
            sub = -(-chunk // -(-chunk // sub))                 # pieces of equal length
        scratch = scratch_bytes(sub)
        fixed = 1024 + CW * 2 * 128 * 4 + scratch
        fit = (room - scratch) // stage
        nstage = min(stages or fit, fit, 48)
        if nstage < 2:
            raise FusedDecodingError(
                f"fused decoding: this model's activations and attention take {fixed // 1024} KB of shared "
                f"memory, which leaves room for {nstage} weight stages of {stage // 1024} KB (2 needed); "
                f"a smaller kc may fit")
        defines = dict(LAYERS=c.num_hidden_layers, HID=hid, INTER=inter, VOCAB=c.vocab_size,
                       VOCAB_TILED=-(-c.vocab_size // 16) * 16, H=H, HKV=hkv, D=D,
                       NQKV=(H + 2 * hkv) * D, BS=c.block_size, NT=nt, CW=CW, KCMAX=kc, KMAX=kmax,
                       ATTN_OFFSET=attn_offset, NITEMS=self.nchunks * hkv, RMAX=rmax, SLACK=self.slack)
        code = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + _SOURCE.read_text()
        smem = fixed + nstage * stage
        return dict(kernel=self._compile(code, smem), code=code, smem=smem, stages=nstage, piece=sub,
                    layout=(np.int32(nstage), np.int32(scratch), np.int32(sub)))

    def _compile(self, code: str, smem: int):
        """`decode_step` of `code`, compiled once per process (NVRTC; CuPy also caches on disk)."""
        if code not in _KERNELS:
            _KERNELS[code] = self.cupy.RawModule(code=code, options=("-std=c++17",)).get_function("decode_step")
        kernel = _KERNELS[code]
        kernel.max_dynamic_shared_size_bytes = max(smem, kernel.max_dynamic_shared_size_bytes)
        return kernel

    def _tile(self, w: torch.Tensor, kc: int) -> torch.Tensor:
        """A copy of W [N, K] (zero rows appended up to a multiple of 16) laid out as
        [N/16][K/kc][16][kc] (kc = min(K, kc)), so that one ring stage is one contiguous bulk copy;
        in each row the 16-byte pieces c are stored at c ^ (4 * (row & 1)), so that the consumers'
        reads of rows g and g + 1 fall on different shared-memory banks."""
        if w.shape[0] % 16:                       # lm_head of a vocabulary that is not a multiple of 16
            w = torch.cat([w, w.new_zeros(16 - w.shape[0] % 16, w.shape[1])])
        n, k = w.shape
        kc = min(k, kc)
        t = w.detach().reshape(n // 16, 16, k // kc, kc // 8, 8).permute(0, 2, 1, 3, 4)
        rows = torch.arange(16, device=w.device)[:, None]
        swizzle = torch.arange(kc // 8, device=w.device)[None, :] ^ (4 * (rows & 1))
        t = t.gather(3, swizzle[None, None, :, :, None].expand(t.shape)).contiguous()
        self.tiled.append(t)
        return t

    def step_logits(self, input_ids, position_ids, valid, cache, slots, kv_len, logits_from=0, run_layer=None,
                    *, phases: tuple[int, int] | None = None, trace: torch.Tensor | None = None,
                    detail: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [1, T - logits_from, V] of T new tokens written at `slots` (contiguous, from the
        cache's filled length); attention spans the committed keys and the new ones (`kv_len` and
        `valid` are implied at batch 1 and unused; `run_layer` does not apply). The kernel reads the
        token ids and positions itself (embedding rows, RoPE table rows): positions must lie below
        the cache's max_len, as at batch 1 where a token's position is its slot.

        phases: run phases [lo, hi) only (5 per layer, then the logits; tests). trace: an int64
        [programs, hi + 1, 2] tensor that receives each block's GPU clock (ns) at the start (after
        the barrier) and end of each phase (`python -m dice.bench fused` reads it). detail: an
        int64 [programs, hi + 1, 8] tensor for the slots that the kernel built with TRACE records
        (fused_decode.cu says which); that build, compiled on first use, runs this launch."""
        if cache is not self.cache:
            raise ValueError("this FusedDecoder was built for another cache")
        T = input_ids.shape[1]
        if input_ids.shape[0] != 1 or T > NT:
            raise ValueError(f"fused decoding runs 1 sequence of at most {NT} tokens; got {tuple(input_ids.shape)}")
        c = self.cfg
        ids, positions = (t.reshape(T).to(torch.long).contiguous() for t in (input_ids, position_ids))
        self.counters.zero_()
        lo, hi = phases or (0, self.all_phases)
        k = self.kernels[min(r for r in self.kernels if r >= T)]
        kernel, out = k["kernel"], trace
        if detail is not None:      # the TRACE build writes `detail` behind the trace's 2 slots
            kernel = self._compile("#define TRACE 1\n" + k["code"], k["smem"])
            out = torch.zeros(self.programs * (hi + 1) * 10, dtype=torch.int64, device=self.h.device)
        p = lambda t: np.uint64(t.data_ptr())  # noqa: E731
        args = (p(self.table), p(self.h), p(self.qkv), p(self.att), p(self.act), p(self.part_o), p(self.part_ml),
                p(self.counters), p(ids), p(positions), p(self.model.model.embed_tokens.weight), p(self.cos),
                p(self.sin), p(slots), p(self.model.model.norm.weight), p(self.lm_tiled), p(self.logits),
                p(self.greedy_part), np.uint64(self.greedy_tok.data_ptr() if self.greedy else 0),
                p(self.greedy_conf), np.int32(c.mask_token_id), np.int32(T), np.int32(logits_from), np.int32(lo),
                np.int32(hi), np.int32(cache.max_len), np.float32(c.rms_norm_eps), np.float32(c.head_dim ** -0.5),
                *k["layout"], np.uint64(0 if out is None else out.data_ptr()))
        with self.cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            kernel((self.programs,), (32 * (CW + 1),), args, shared_mem=k["smem"])
        if detail is not None:
            split = self.programs * (hi + 1) * 2
            detail.view(-1).copy_(out[split:])
            if trace is not None:
                trace.view(-1).copy_(out[:split])
        return self.logits[:T - logits_from].unsqueeze(0)

    def greedy_choice(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last launch's greedy choice for its n logit rows (built with greedy=True): tokens
        [1, n] and confidences [1, n], as `dice.sampling.sampler.greedy_choice` gives them for the returned
        logits with the mask token left out (up to float32 summation order in the confidence)."""
        if not self.greedy:
            raise ValueError("this FusedDecoder was built without greedy=True")
        return self.greedy_tok[:n].unsqueeze(0), self.greedy_conf[:n].unsqueeze(0)


def chunks_per_head(programs: int, kv_heads: int, max_len: int) -> int:
    """Attention work items per KV head: one per block (`programs // kv_heads`), or half as many for
    a cache of at most SHORT_CACHE slots, where merging 8 partial softmaxes instead of 16 saves more
    than the longer chunks cost (H200, SDAR-1.7B: 1.53 vs 1.57 ms at 1K cached tokens, 1.63 vs 1.62
    at 2K, 1.73 vs 1.67 at 3K; README Performance)."""
    per_head = max(programs // kv_heads, 1)
    return max(per_head // 2, 1) if max_len <= SHORT_CACHE else per_head


def _unsupported(c, w, cache, kc: int) -> str | None:
    """Why this model / cache cannot take the fused step, or None."""
    if w.dtype != torch.bfloat16:
        return f"needs bfloat16 weights; got {w.dtype}"
    if cache.k[0].shape[0] != 1:
        return f"runs one sequence; the cache holds {cache.k[0].shape[0]}"
    if c.head_dim not in (32, 64, 128) or c.num_attention_heads % c.num_key_value_heads:
        return "needs head_dim 32, 64 or 128 and whole GQA groups"
    if 2 * c.block_size > NT:
        return f"runs at most {NT} tokens per forward: block_size <= {NT // 2}"
    H, hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    for k in (c.hidden_size, H * D, c.intermediate_size):
        if k % 64 or (k > kc and k % kc):
            return f"needs reduction sizes divisible by 64 and, above kc={kc}, by kc; got {k}"
    for n in (c.hidden_size, (H + 2 * hkv) * D, c.intermediate_size):
        if n % 16:
            return f"needs weight row counts divisible by 16; got {n}"
    if w.device.type != "cuda" or torch.cuda.get_device_capability(w.device) < (9, 0):
        return "needs a Hopper (SM90) or newer GPU"
    return None


@functools.cache
def _max_shared(device) -> int:
    """Opt-in shared memory per block (bytes); asked once (CuPy reads all the device's properties)."""
    import cupy   # optional (the [gpu] extra); FusedDecoder checked it is there
    return cupy.cuda.runtime.getDeviceProperties(device.index or 0)["sharedMemPerBlockOptin"]
