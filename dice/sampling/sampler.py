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
Decoding paths (`Engine`): `use_cache=False` recomputes the whole sequence at every step (the
brute-force reference); the cached step (`CachedForward`) runs a block against the KV cache, replayed
from CUDA graphs on CUDA and optionally `torch.compile`d; `fused=True` hands a single prompt's steps
to the optional persistent kernel (`dice.fused.FusedForward`, the one hook into the fast path).
`generate` takes what a step chooses as one `Sampling` (`dice.sampling.choice`) and how the steps
run as one `Engine`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..model.attention import block_causal_mask
from ..model.sdar import compute_device
from .choice import (REMASKING, Sampling, choose_tokens, greedy_choice,  # noqa: F401 (re-exported)
                     row_seeds, select_positions, tokens_per_step, uniform_noise, unmask)



@dataclass
class Generated:
    """One prompt's generation. `tail_tokens` / `tail_step_map`: the last block's positions after the
    cut, which were context for every step of that block (TraceRL replays them, DESIGN.md §7)."""
    tokens: list[int]
    step_map: list[int]
    denoising_steps: int
    tail_tokens: list[int] = field(default_factory=list)
    tail_step_map: list[int] = field(default_factory=list)


@dataclass
class GenerationResult:
    sequences: list[Generated]
    forwards: int = 0                     # model forwards run (prefill, steps; fused commits count once)
    seconds: float = 0.0

    tokens = property(lambda self: [s.tokens for s in self.sequences])
    step_map = property(lambda self: [s.step_map for s in self.sequences])
    denoising_steps = property(lambda self: [s.denoising_steps for s in self.sequences])
    tail_tokens = property(lambda self: [s.tail_tokens for s in self.sequences])
    tail_step_map = property(lambda self: [s.tail_step_map for s in self.sequences])

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.sequences)


_COMPILED: dict[str, Callable] = {}


def _compiled(name: str, fn: Callable) -> Callable:
    """`torch.compile(fn)`, made once per process so that its compilations are reused."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False)
    return _COMPILED[name]


class BruteForce:
    """The no-cache reference: every step recomputes the whole sequence up to the block's end."""

    def __init__(self, model, compile: bool = False):
        self.model = model
        self.choose_tokens = _compiled("choose", choose_tokens) if compile else choose_tokens

    def block_logits(self, rows: "Rows", b0: int, b1: int, commit_previous: bool) -> torch.Tensor:
        x, pos, valid = rows.x[:, :b1], rows.pos[:, :b1], rows.valid[:, :b1]
        keys_ok = valid[:, None, :] | torch.eye(b1, dtype=torch.bool, device=x.device)
        return self.model(x, pos, block_causal_mask(pos, self.model.config.block_size) & keys_ok)[:, b0:b1]

    def choose(self, logits: torch.Tensor, uniforms, s: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
        return self.choose_tokens(logits, self.model.config.mask_token_id, s.temperature, s.top_k, s.top_p, uniforms,
                                  s.confidence)

    def keep_rows(self, keep: torch.Tensor) -> None:
        pass


class CachedForward(BruteForce):
    """`model.forward_cached` against a KV cache, or on CUDA its replay from CUDA graphs captured once per shape.

    A block step is a few hundred small kernels; at batch 1 launching them costs more than the
    math, so the step is captured with the write position passed as a device tensor and the
    attention spanning a fixed `kv_len`: the cache's filled length rounded up to `KV_BUCKET`
    slots (one graph per bucket, so a batch-64 step does not read the empty end of the cache).
    `compile=True` runs every decoder layer through one `torch.compile`d function (fused norms,
    RoPE and casts), with kv_len the whole cache (`full_cache`) so that each (batch, tokens) shape
    compiles once. A finished block's keys/values are committed in the same forward as the next
    block's first step. Graphs hold the cache's memory, so they are dropped with `keep_rows`.
    """

    KV_BUCKET = 256

    def __init__(self, model, cache, use_graphs: bool, compile: bool = False):
        super().__init__(model, compile)
        self.cache, self.use_graphs = cache, use_graphs
        # one compiled call serves all layers: they differ only in their weights, the compiler's inputs
        self.run_layer = _compiled("layer", lambda layer, *args: layer(*args)) if compile else None
        self.full_cache = compile
        self.graphs: dict[tuple, dict] = {}

    def step_logits(self, *args) -> torch.Tensor:
        return self.model.step_logits(*args, self.run_layer)

    def block_logits(self, rows: "Rows", b0: int, b1: int, commit_previous: bool) -> torch.Tensor:
        c0 = b0 - self.model.config.block_size if commit_previous else b0
        return self(rows.x[:, c0:b1], rows.pos[:, c0:b1], rows.valid[:, c0:b1], b0 - c0, b0 - c0)

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.cache.keep_rows(keep)
        self.graphs.clear()

    def __call__(self, ids, pos, valid, commit: int, logits_from: int) -> torch.Tensor:
        cache = self.cache
        kv_len = cache.max_len if self.full_cache else None
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


class Rows:
    """The sequences still in the batch. Prompts are left-padded by whole blocks so that every
    row's first generated block has the same index F; per row: tokens `x`, positions (0 at the
    first real token), `valid` (not padding), `generated` (still to be sampled), the step map,
    its denoising-step count and noise seed; on the host its prompt's index `index`, the prompt's
    remainder `rem`, its first generated position `g0` and its length limit `limit` (max_new_tokens,
    or less where `lengths` says so), which decide a static block's step count and every finish by
    length without reading the GPU."""

    def __init__(self, prompts, block_size: int, max_new_tokens: int, mask_id: int, seeds: list[int], device,
                 lengths: Sequence[int] | None = None):
        bs, lens = block_size, torch.tensor([len(p) for p in prompts])
        full, rem = lens // bs, lens % bs
        self.F = int(full.max())
        self.blocks = int((1 + (max_new_tokens - (bs - rem)).clamp(min=0).add(bs - 1).div(bs, rounding_mode="floor")).max())
        total, pad = (self.F + self.blocks) * bs, (self.F - full) * bs
        x = torch.full((len(prompts), total), mask_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            x[i, int(pad[i]):int(pad[i]) + len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        idx = torch.arange(total)
        g0 = self.F * bs + rem
        self.x, self.pos = x.to(device), (idx[None] - pad[:, None]).clamp(min=0).to(device)
        self.valid, self.generated = (idx[None] >= pad[:, None]).to(device), (idx[None] >= g0[:, None]).to(device)
        self.step_map = torch.zeros_like(self.x)
        self.steps = torch.zeros(len(prompts), dtype=torch.long, device=device)
        self.seeds = torch.tensor(seeds, dtype=torch.long, device=device)
        self.index, self.rem, self.g0 = list(range(len(prompts))), rem.tolist(), g0.tolist()
        self.limit = [max_new_tokens] * len(prompts) if lengths is None else [min(max_new_tokens, n) for n in lengths]
        self.done = [False] * len(prompts)

    def masks_in_block(self, j: int, block_size: int) -> list[int]:
        return [0 if d else block_size - (r if j == 0 else 0) for d, r in zip(self.done, self.rem)]

    def counted_in_block(self, b0: int, b1: int) -> int:
        """Positions of block [b0, b1) within the rows' length limits: what progress counts, so the
        count ends at the limits (a last block's positions past a limit are generated, then cut)."""
        return sum(max(0, min(b1, g0 + limit) - max(b0, g0))
                   for d, g0, limit in zip(self.done, self.g0, self.limit) if not d)

    def finished(self, b0: int, b1: int, eos: torch.Tensor | None) -> list[int]:
        """Rows that finish with the block [b0, b1): enough positions, or an eos id in the block
        (only this reads the GPU, once a block, and only when there are eos ids)."""
        ends = [not d and b1 - g0 >= limit for d, g0, limit in zip(self.done, self.g0, self.limit)]
        if eos is not None:
            has_eos = (torch.isin(self.x[:, b0:b1], eos) & self.generated[:, b0:b1]).any(-1).tolist()
            ends = [f or (e and not d) for f, e, d in zip(ends, has_eos, self.done)]
        return [r for r, f in enumerate(ends) if f]

    def result(self, r: int, b1: int, eos_ids: Sequence[int]) -> Generated:
        """Row r's tokens cut after the first eos id (kept) or at its limit; it leaves sampling."""
        toks, smap = self.x[r, self.g0[r]:b1].tolist(), self.step_map[r, self.g0[r]:b1].tolist()
        cut = min(self.limit[r], next((k + 1 for k, t in enumerate(toks) if t in eos_ids), len(toks)))
        self.done[r] = True
        self.generated[r] = False
        return Generated(toks[:cut], smap[:cut], int(self.steps[r]), toks[cut:], smap[cut:])

    def drop_done(self) -> torch.Tensor:
        """Remove finished rows; returns the kept rows' indices for the cache."""
        kept = [r for r, d in enumerate(self.done) if not d]
        keep = torch.tensor(kept, device=self.x.device)
        for name in ("x", "pos", "valid", "generated", "step_map", "steps", "seeds"):
            setattr(self, name, getattr(self, name)[keep])
        for name in ("index", "rem", "g0", "limit", "done"):
            setattr(self, name, [getattr(self, name)[r] for r in kept])
        return keep


@dataclass(frozen=True)
class Engine:
    """How `generate` runs its steps. None changes the rules, so the tokens agree (exactly in float32;
    bf16 paths round differently and may flip near-ties). use_cache=False: the brute-force reference,
    recomputing the whole sequence at every step. cuda_graphs: replay block steps from CUDA graphs
    (CUDA with use_cache only). compile: `torch.compile` the decoder layers and the token choice
    (use_cache only; each new shape compiles first). fused: a single prompt's steps as one persistent
    CUDA kernel (`dice.fused`; a batch takes the layer-by-layer path)."""
    use_cache: bool = True
    cuda_graphs: bool = True
    compile: bool = False
    fused: bool = False


@torch.inference_mode()
def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
             eos_token_ids: Sequence[int] = (), seed: int | Sequence[int] | None = None, engine: Engine = Engine(),
             lengths: Sequence[int] | None = None, progress: Callable[[int], None] | None = None,
             on_finish: Callable[[int, Generated], None] | None = None) -> GenerationResult:
    """Generate a response for every prompt (lists of token ids); see the module docstring.

    max_new_tokens: the most positions generated per prompt. sampling: the steps per block, the
    remasking rule and the token choice (`Sampling`; default: greedy, 4 steps, static remasking).
    eos_token_ids: a sequence ends after the block holding one of them. seed: an int (row i uses
    seed + i) or one seed per prompt; None draws one from torch's RNG. engine: how the steps run
    (`Engine`: KV cache, CUDA graphs, torch.compile, the fused kernel; same results). lengths: per
    prompt, the response length at which its sequence ends as if it had sampled an eos there (capped
    at max_new_tokens; the KV cache is sized by max_new_tokens as without it): benchmarks give a
    random-weight model, which never samples an eos, real response lengths. progress: called after
    every block with the number of positions generated so far. on_finish(i, generated): called as
    prompt i's sequence finishes and leaves the batch, e.g. to verify it while the others still
    generate (BiC-RL rollouts, DESIGN.md §7).
    """
    _check_arguments(model, prompts, max_new_tokens, lengths)
    cfg, device, started = model.config, compute_device(model), time.perf_counter()
    bs, schedule = cfg.block_size, tokens_per_step(cfg.block_size, sampling.steps_per_block)
    rows = Rows(prompts, bs, max_new_tokens, cfg.mask_token_id, row_seeds(seed, len(prompts)), device, lengths)
    step, forwards = _make_step(model, rows, engine, greedy=sampling.temperature == 0)
    commit = _compiled("unmask", unmask) if engine.compile else unmask
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device) if eos_token_ids else None
    out: dict[int, Generated] = {}
    positions_done = 0
    for j in range(rows.blocks):
        b0, b1 = (rows.F + j) * bs, (rows.F + j + 1) * bs
        masked, masks = rows.generated[:, b0:b1].clone(), rows.masks_in_block(j, bs)
        positions_done += rows.counted_in_block(b0, b1)
        for k, n_k in enumerate(schedule):
            # static: a row with m masks is complete once the schedule has unmasked m; dynamic
            # unmasks a data-dependent number, so it asks the GPU (one sync a step)
            if (sum(schedule[:k]) >= max(masks)) if sampling.remasking == "low_confidence_static" else not masked.any():
                break
            left = masked.sum(-1)
            logits = step.block_logits(rows, b0, b1, commit_previous=j > 0 and k == 0)
            forwards += 1
            rows.steps += (left > 0).long()
            u = uniform_noise(rows.seeds, rows.steps, rows.pos[:, b0:b1]) if sampling.temperature > 0 else None
            tok, conf = step.choose(logits, u, sampling)
            rows.x[:, b0:b1], rows.step_map[:, b0:b1], masked = commit(
                tok, conf, rows.x[:, b0:b1], rows.step_map[:, b0:b1], masked, left.clamp(max=n_k), rows.steps,
                sampling.remasking, sampling.threshold)
        finished = rows.finished(b0, b1, eos)
        for r in finished:
            out[rows.index[r]] = rows.result(r, b1, eos_token_ids)
            if on_finish is not None:
                on_finish(rows.index[r], out[rows.index[r]])
        if progress is not None:
            progress(positions_done)
        if len(out) == len(prompts):
            break
        # with graphs, drop finished rows only once half the batch is done (each drop re-captures)
        if finished and (not getattr(step, "use_graphs", False) or 2 * sum(rows.done) >= len(rows.done)):
            step.keep_rows(rows.drop_done())
    return GenerationResult([out[i] for i in range(len(prompts))], forwards, time.perf_counter() - started)


def _make_step(model, rows: Rows, engine: Engine, greedy: bool) -> tuple[BruteForce, int]:
    """The step runner for `generate` and the forwards it ran already (the prompts' full blocks,
    prefilled into a new KV cache). greedy: temperature 0, which the fused kernel chooses itself."""
    if not engine.use_cache:
        return BruteForce(model, engine.compile), 0
    cache = model.new_cache(len(rows.index), rows.x.shape[1])
    graphs = engine.cuda_graphs and rows.x.device.type == "cuda"
    if engine.fused and len(rows.index) == 1:
        from ..fused import FusedForward   # here, not at the top: dice.fused builds on this module's CachedForward
        step = FusedForward(model, cache, graphs, engine.compile, greedy=greedy)
    else:
        step = CachedForward(model, cache, graphs, engine.compile)
    n = rows.F * model.config.block_size
    if n:
        model.forward_cached(rows.x[:, :n], rows.pos[:, :n], cache, commit=n, valid=rows.valid[:, :n], logits_from=n)
    return step, int(n > 0)


def _check_arguments(model, prompts, max_new_tokens: int, lengths: Sequence[int] | None) -> None:
    """`generate`'s arguments besides `Sampling` (which checks its own): a ValueError naming the fault."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if lengths is not None and (len(lengths) != len(prompts) or min(lengths) < 1):
        raise ValueError(f"lengths needs one length >= 1 per prompt; got {len(lengths)} for {len(prompts)} prompts")
    bad = [t for p in prompts for t in p if not 0 <= t < model.config.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary [0, {model.config.vocab_size})")
