"""Block-diffusion sampling with a KV cache (DESIGN.md §5).

Blocks of B = `config.block_size` tokens sit on the absolute position grid: a prompt of P tokens
contributes P // B full blocks, prefilled into the KV cache, and its last P mod B tokens share the
first generated block, whose other positions start as MASK. Every later block starts all MASK.

Within a block, step s = 0..S-1 unmasks min(n_s, masks left) tokens, with
    n_s = floor(B / S) + [s < B mod S]                       (tokens per step, from the block size)
Each step computes the block's logits given the clean cache (bidirectional inside the block),
never samples the mask token, draws a token per masked position, and scores it by its
confidence c = p(token) under the temperature softmax before top-k / top-p filtering
(temperature 0: argmax, c = its softmax probability). Then
    low_confidence_static:  unmask the n_s masked positions with the highest c;
    low_confidence_dynamic: unmask every masked position with c > threshold, or the top n_s if
                            fewer qualify.
A finished block's keys/values are committed in the same forward as the next block's first step
(the two blocks are block-causal to each other, so this equals a separate commit forward).
Generation stops per sequence after the block holding an eos id, or once `max_new_tokens`
positions were generated; tokens are cut after the first eos (kept) or at `max_new_tokens`.
`step_map[i]` is the sequence's own denoising-forward count (from 1) when token i was unmasked.
The cut falls inside the last block, whose positions after it were denoised like the others and
were context for every step of that block; they are returned as the tail (`tail_tokens`,
`tail_step_map`, empty when the cut is at the block's end) so that TraceRL can replay those
steps exactly (DESIGN.md §7).

Sequences of different lengths are batched by left padding each prompt by whole blocks so that
every sequence's first generated block has the same index; padding is never attended, position
ids start at 0 at each sequence's first real token, and sampling noise is a hash of (row seed,
step, position), so a batch does not change a sequence's result: exactly in float32; in bf16 a
different batch shape rounds differently and may flip near-ties. An int seed gives row i the seed
seed + i; pass one seed per prompt for results independent of the row.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .attention import block_causal_mask

REMASKING = ("low_confidence_static", "low_confidence_dynamic")


@dataclass
class GenerationResult:
    tokens: list[list[int]]
    step_map: list[list[int]]
    forwards: int = 0                     # model forwards run (prefill, steps; fused commits count once)
    seconds: float = 0.0
    denoising_steps: list[int] = field(default_factory=list)   # per sequence
    # per sequence, the last block's positions after the cut, and the steps that unmasked them
    tail_tokens: list[list[int]] = field(default_factory=list)
    tail_step_map: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


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


def _row_seeds(seed: int | Sequence[int] | None, n: int) -> list[int]:
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
                  uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, confidence) per position of [B, T, V] logits; see the module docstring."""
    logits = logits.to(torch.float32, copy=True)   # a copy: the input may be a CUDA graph's output buffer
    logits[..., mask_token_id] = float("-inf")
    if temperature == 0:
        return greedy_choice(logits)
    scaled = logits / temperature
    probs = scaled.softmax(-1)
    cdf = filter_logits(scaled, top_k, top_p).softmax(-1).cumsum(-1)
    total = cdf[..., -1:]
    # strictly below the total: a target rounded up to it would select past the last kept token
    # (clamped to the last id, which can be the mask or a filtered-out token)
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum((uniforms.unsqueeze(-1) * total.double()).float(), below_total)
    tok = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tok, probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def select_positions(conf: torch.Tensor, masked: torch.Tensor, n: torch.Tensor, remasking: str,
                     threshold: float) -> torch.Tensor:
    """Which masked positions to unmask this step: [B, T] bool. n: [B] tokens this step per row
    (already min(n_s, masks left)). Ties go to the lower position."""
    score = conf.masked_fill(~masked, -1.0)
    order = score.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    top_n = rank < n[:, None]
    if remasking == "low_confidence_static":
        return top_n
    confident = masked & (conf > threshold)
    return torch.where((confident.sum(-1) >= n)[:, None], confident, top_n)


def denoise(logits: torch.Tensor, x_block: torch.Tensor, step_map_block: torch.Tensor, masked: torch.Tensor,
            n: torch.Tensor, steps: torch.Tensor, uniforms: torch.Tensor | None, *, mask_token_id: int,
            temperature: float, top_k: int, top_p: float, remasking: str, threshold: float,
            choice: tuple[torch.Tensor, torch.Tensor] | None = None):
    """One denoising step on a block: choose a token per position, unmask the selected ones.
    Returns the block's new (tokens, step map, still-masked). choice: (tokens, confidences) the
    forward already chose greedily from these logits (the fused kernel's), used instead."""
    tok, conf = choice or choose_tokens(logits, mask_token_id, temperature, top_k, top_p, uniforms)
    chosen = select_positions(conf, masked, n, remasking, threshold)
    return (torch.where(chosen, tok, x_block), torch.where(chosen, steps[:, None], step_map_block),
            masked & ~chosen)


class CachedForward:
    """`model.forward_cached`, or on CUDA its replay from CUDA graphs captured once per shape.

    A block step is a few hundred small kernels; at batch 1 launching them costs more than the
    math, so the step is captured with the write position passed as a device tensor and the
    attention spanning a fixed `kv_len`: the cache's filled length rounded up to `KV_BUCKET`
    slots (one graph per bucket, so a batch-64 step does not read the empty end of the cache).
    `compile=True` runs every decoder layer through one `torch.compile`d function (fused norms,
    RoPE and casts), with kv_len the whole cache so that each (batch, tokens) shape compiles
    once. `fused=True` replaces the layer-by-layer step by `dice.fused_decode.FusedDecoder`'s
    single kernel (batch 1), also with kv_len the whole cache, and with `greedy` it also makes the
    greedy choice (`greedy_choice`). Graphs hold the cache's memory, so `reset` must follow any
    change of the cache's tensors (dropping finished rows).
    """

    KV_BUCKET = 256

    def __init__(self, model, cache, use_graphs: bool, compile: bool = False, fused: bool = False,
                 greedy: bool = False):
        self.model, self.cache, self.use_graphs = model, cache, use_graphs
        self.run_layer = _compiled_layer() if compile and not fused else None
        self.fused = None
        if fused:
            from .fused_decode import FusedDecoder     # imported when asked for: it needs CuPy and a GPU
            self.fused = FusedDecoder(model, cache, greedy=greedy)
        self.graphs: dict[tuple, dict] = {}

    def step_logits(self, *args) -> torch.Tensor:
        """`model.step_logits`, or the fused kernel's equivalent."""
        if self.fused is not None:
            return self.fused.step_logits(*args)
        return self.model.step_logits(*args, self.run_layer)

    def greedy_choice(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last forward's greedy (tokens, confidences) for its n logit rows when the fused
        kernel made them, else None."""
        return self.fused.greedy_choice(n) if self.fused is not None and self.fused.greedy else None

    def reset(self) -> None:
        self.graphs.clear()

    def __call__(self, ids, pos, valid, commit: int, logits_from: int) -> torch.Tensor:
        cache = self.cache
        # compiled or fused: one kv_len, so each (batch, tokens) shape compiles (or is captured) once
        kv_len = cache.max_len if self.run_layer is not None or self.fused is not None else None
        cache.check_room(ids.shape[1])
        if not self.use_graphs:
            slots = torch.arange(cache.length, cache.length + ids.shape[1], device=ids.device)
            logits = self.step_logits(ids, pos, valid, cache, slots, kv_len or cache.length + ids.shape[1], logits_from)
            cache.commit(valid, commit)
            return logits
        kv_len = kv_len or min(cache.max_len, -(-(cache.length + ids.shape[1]) // self.KV_BUCKET) * self.KV_BUCKET)
        key = (*ids.shape, logits_from, kv_len)
        g = self.graphs.get(key) or self._capture(key, ids, pos, valid)
        g["ids"].copy_(ids)
        g["pos"].copy_(pos)
        g["valid"].copy_(valid)
        g["start"].fill_(cache.length)
        g["graph"].replay()
        cache.commit(valid, commit)
        return g["logits"]

    def _capture(self, key, ids, pos, valid) -> dict:
        logits_from, kv_len = key[2:]
        # every tensor the graph reads must outlive it: they all live in `g`
        g = {"ids": ids.clone(), "pos": pos.clone(), "valid": valid.clone(),
             "start": torch.full((), self.cache.length, dtype=torch.long, device=ids.device),
             "offsets": torch.arange(ids.shape[1], device=ids.device)}

        def body():
            return self.step_logits(g["ids"], g["pos"], g["valid"], self.cache, g["start"] + g["offsets"], kv_len,
                                    logits_from)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()  # warm-up outside capture (lazy init, compilation); writes scratch slots only
        torch.cuda.current_stream().wait_stream(side)
        g["graph"] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g["graph"]):
            g["logits"] = body()
        self.graphs[key] = g
        return g


_COMPILED: dict[str, Callable] = {}


def _compiled(name: str, fn: Callable) -> Callable:
    """`torch.compile(fn)`, made once per process so that its compilations are reused."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False)
    return _COMPILED[name]


def _compiled_layer():
    """One compiled decoder-layer call: the layers differ only in their weights, which the
    compiler takes as inputs, so a shape compiles once for all layers (and all models)."""
    return _compiled("layer", lambda layer, *args: layer(*args))


@torch.inference_mode()
def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, steps_per_block: int = 4,
             remasking: str = "low_confidence_static", threshold: float = 0.9, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, eos_token_ids: Sequence[int] = (), use_cache: bool = True,
             seed: int | Sequence[int] | None = None, cuda_graphs: bool = True, compile: bool = False,
             fused: bool = False, progress: Callable[[int], None] | None = None) -> GenerationResult:
    """Generate a response for every prompt (lists of token ids); see the module docstring.

    use_cache=False recomputes the whole sequence at every step: the brute-force reference.
    seed: an int (row i uses seed + i) or one seed per prompt; None draws one from torch's RNG.
    cuda_graphs: replay block steps from CUDA graphs (CUDA with use_cache only; same results).
    compile: run decoder layers and the token choice through `torch.compile` (use_cache only;
    worth it for long runs at fixed shapes, such as benchmarks: each new shape compiles first).
    fused: run each denoising step of a single prompt as one persistent CUDA kernel
    (`dice.fused_decode`; use_cache only, batches of several prompts take the layer-by-layer path).
    progress: called after every block with the number of positions generated so far.
    """
    if remasking not in REMASKING:
        raise ValueError(f"remasking must be one of {REMASKING}, got {remasking!r}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1 or steps_per_block < 1:
        raise ValueError("max_new_tokens and steps_per_block must be >= 1")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1 or not 0 <= threshold <= 1:
        raise ValueError(f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1 and 0 <= threshold <= 1; got "
                         f"{temperature}, {top_k}, {top_p}, {threshold}")
    cfg = model.config
    bad = [t for p in prompts for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary [0, {cfg.vocab_size})")
    bs, mask_id, device = cfg.block_size, cfg.mask_token_id, next(model.parameters()).device
    schedule = tokens_per_step(bs, steps_per_block)
    n_rows = len(prompts)
    start = time.perf_counter()

    lens = torch.tensor([len(p) for p in prompts])
    full, rem = lens // bs, lens % bs
    F = int(full.max())
    blocks_needed = 1 + (max_new_tokens - (bs - rem)).clamp(min=0).add(bs - 1).div(bs, rounding_mode="floor")
    total_len = (F + int(blocks_needed.max())) * bs
    pad = (F - full) * bs

    x = torch.full((n_rows, total_len), mask_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        x[i, int(pad[i]):int(pad[i]) + len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    idx = torch.arange(total_len)
    pos = (idx[None] - pad[:, None]).clamp(min=0)
    valid = idx[None] >= pad[:, None]
    gen_start = F * bs + rem                          # index of each row's first generated position
    generated = (idx[None] >= gen_start[:, None]).to(device)
    x, pos, valid = x.to(device), pos.to(device), valid.to(device)
    step_map = torch.zeros(n_rows, total_len, dtype=torch.long, device=device)
    steps = torch.zeros(n_rows, dtype=torch.long, device=device)
    seeds = torch.tensor(_row_seeds(seed, n_rows), dtype=torch.long, device=device)
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)

    # Host-side row state: which original row each batch row is, its prompt remainder, its first
    # generated index, whether it is done. With it, a static block's step count and every row's
    # finish by length are known without reading the GPU, so the host enqueues steps ahead of it.
    rows, row_rem, row_g0 = list(range(n_rows)), rem.tolist(), gen_start.tolist()
    row_done = [False] * n_rows
    out_tokens: list[list[int]] = [[] for _ in range(n_rows)]
    out_steps: list[list[int]] = [[] for _ in range(n_rows)]
    out_n_steps = [0] * n_rows
    out_tail_tokens: list[list[int]] = [[] for _ in range(n_rows)]
    out_tail_steps: list[list[int]] = [[] for _ in range(n_rows)]
    forwards = positions_done = 0
    cache = model.new_cache(n_rows, total_len) if use_cache else None
    graphs = use_cache and cuda_graphs and device.type == "cuda"
    step_forward = (CachedForward(model, cache, graphs, compile, fused and n_rows == 1, greedy=temperature == 0)
                    if use_cache else None)
    if use_cache and F > 0:
        model.forward_cached(x[:, :F * bs], pos[:, :F * bs], cache, commit=F * bs, valid=valid[:, :F * bs],
                             logits_from=F * bs)
        forwards += 1
    pending_commit = False
    step = _compiled("denoise", denoise) if compile else denoise
    static = remasking == "low_confidence_static"
    sampling = dict(mask_token_id=mask_id, temperature=temperature, top_k=top_k, top_p=top_p, remasking=remasking,
                    threshold=threshold)

    for j in range(int(blocks_needed.max())):
        b0, b1 = (F + j) * bs, (F + j + 1) * bs
        masked = generated[:, b0:b1].clone()
        masks = [0 if d else bs - (r if j == 0 else 0) for d, r in zip(row_done, row_rem)]
        positions_done += sum(masks)
        for s, n_s in enumerate(schedule):
            # static: a row with m masks is complete once the schedule has unmasked m; dynamic
            # unmasks a data-dependent number, so it asks the GPU (one sync a step)
            complete = sum(schedule[:s]) >= max(masks) if static else not masked.any()
            if complete:
                break
            left = masked.sum(-1)
            active = left > 0
            if use_cache:
                c0 = b0 - bs if pending_commit else b0
                logits = step_forward(x[:, c0:b1], pos[:, c0:b1], valid[:, c0:b1], b0 - c0, b0 - c0)
                choice = step_forward.greedy_choice(bs)
                pending_commit = False
            else:
                keys_ok = valid[:, None, :b1] | torch.eye(b1, dtype=torch.bool, device=device)
                logits = model(x[:, :b1], pos[:, :b1], block_causal_mask(pos[:, :b1], bs) & keys_ok)[:, b0:b1]
                choice = None
            forwards += 1
            steps += active.long()
            u = uniform_noise(seeds, steps, pos[:, b0:b1]) if temperature > 0 else None
            x[:, b0:b1], step_map[:, b0:b1], masked = step(logits, x[:, b0:b1], step_map[:, b0:b1], masked,
                                                           left.clamp(max=n_s), steps, u, choice=choice, **sampling)
        pending_commit = True

        # a sequence is finished once it has generated enough or its block holds an eos id; only
        # the eos check reads the GPU (once a block), and only when there are eos ids
        finished = [not d and b1 - g0 >= max_new_tokens for d, g0 in zip(row_done, row_g0)]
        if eos_token_ids:
            has_eos = (torch.isin(x[:, b0:b1], eos) & generated[:, b0:b1]).any(-1)
            finished = [f or (e and not d) for f, e, d in zip(finished, has_eos.tolist(), row_done)]
        newly = [r for r, f in enumerate(finished) if f]
        for r in newly:
            g0 = row_g0[r]
            toks, smap = x[r, g0:b1].tolist(), step_map[r, g0:b1].tolist()
            cut = min(max_new_tokens, next((k + 1 for k, t in enumerate(toks) if t in eos_token_ids), len(toks)))
            out_tokens[rows[r]], out_steps[rows[r]], out_n_steps[rows[r]] = toks[:cut], smap[:cut], int(steps[r])
            out_tail_tokens[rows[r]], out_tail_steps[rows[r]] = toks[cut:], smap[cut:]
            row_done[r] = True
        if progress is not None:
            progress(positions_done)
        if all(row_done):
            break
        if not newly:
            continue
        generated[newly] = False    # a finished row still in the batch is never sampled again
        # drop finished rows; with graphs only once half the batch is done (each drop re-captures)
        if not graphs or 2 * sum(row_done) >= len(row_done):
            keep_rows = [r for r, d in enumerate(row_done) if not d]
            keep = torch.tensor(keep_rows, device=device)
            x, pos, valid, generated, step_map, steps, seeds = (
                t[keep] for t in (x, pos, valid, generated, step_map, steps, seeds))
            rows, row_rem, row_g0, row_done = ([v[r] for r in keep_rows] for v in (rows, row_rem, row_g0, row_done))
            if cache is not None:
                cache.keep_rows(keep)
                step_forward.reset()

    return GenerationResult(out_tokens, out_steps, forwards, time.perf_counter() - start, out_n_steps,
                            out_tail_tokens, out_tail_steps)
