"""`python -m dice.bench fused`: the persistent fused decoding kernel (`dice.fused`) against the
compiled layer-by-layer step, and where its time goes (GPU, Hopper)."""
from __future__ import annotations

import sys

import torch

from ..fused import FusedForward, decoder as fused_decode
from ..fused.tables import phase_detail
from ..model.sdar import random_model
from ..sampling.sampler import CachedForward
from .common import HBM_BYTES_PER_S, forward_weight_bytes, median_replay_ms, table


def bench_fused(args, bench) -> None:
    """The persistent fused decoding kernel (`dice.fused`) against the compiled
    layer-by-layer step: CUDA-graph replays of one block step (T new tokens against a cache of
    `--cache-len`), medians of `--repeats`, the relative error of its logits against the
    layer-by-layer step's, and where a forward's time goes (the kernel's own timestamps: for each
    phase kind, the mean time from one grid barrier's exit to the next, over layers 1-27)."""
    torch.manual_seed(0)
    model = random_model(args.shape)
    c = model.config
    n = args.cache_len
    roofline_ms = forward_weight_bytes(model) / HBM_BYTES_PER_S * 1e3
    ids = torch.randint(0, 150000, (1, n + 8), device="cuda")
    pos = torch.arange(n + 8, device="cuda")[None]
    valid = torch.ones(1, n + 8, dtype=torch.bool, device="cuda")

    def prefilled():
        cache = model.new_cache(1, n + 2 * 8)
        model.forward_cached(ids[:, :n], pos[:, :n], cache, commit=n)
        return cache

    rows = []
    with torch.inference_mode():
        for T, lf in ((4, 0), (8, 4)):
            new = (ids[:, n:n + T], pos[:, n:n + T], valid[:, n:n + T])
            for name in ("compiled layer-by-layer", "fused kernel"):
                bench.check(f"{name}, {T} new tokens")
                bench.progress(f"{name}, {T} new tokens")
                step = (FusedForward(model, prefilled(), True) if name.startswith("fused")
                        else CachedForward(model, prefilled(), True, compile=True))
                step(*new, 0, lf)
                ms = median_replay_ms(next(iter(step.graphs.values()))["graph"], args.repeats)
                rows.append({"step": name, "new tokens": T, "ms / forward": round(ms, 3),
                             "% of roofline": round(100 * roofline_ms / ms, 1), "rel. error vs layers": "-"})
                print(" | ".join(f"{k}={v}" for k, v in rows[-1].items()), file=sys.stderr, flush=True)
            dec, cache = step.decoder, step.cache      # the loop's last step: the fused kernel
            slots = torch.arange(n, n + T, device="cuda")
            ref = model.step_logits(*new, prefilled(), slots, n + T, lf).float()
            got = dec.step_logits(*new, cache, slots, n + T, lf).float()
            rows[-1]["rel. error vs layers"] = f"{((got - ref).norm() / ref.norm()).item():.1e}"
        bench.check("the kernel's timestamps")
        bench.progress("the kernel's timestamps")
        phases = dec.all_phases
        trace = torch.zeros(dec.programs, phases + 1, 2, dtype=torch.int64, device="cuda")
        slots = torch.arange(n, n + 4, device="cuda")
        for _ in range(3):
            dec.step_logits(ids[:, n:n + 4], pos[:, n:n + 4], None, cache, slots, n + 4, trace=trace)
        torch.cuda.synchronize()
        details = []
        for _ in range(3):
            t2, d = torch.zeros_like(trace), trace.new_zeros(*trace.shape[:2], 8)
            dec.step_logits(ids[:, n:n + 4], pos[:, n:n + 4], None, cache, slots, n + 4, trace=t2, detail=d)
            details.append((t2.double().cpu(), d.double().cpu()))
    t = trace[:, :phases].double().cpu() / 1e3
    start = t[..., 0].max(0).values          # the last block's exit from the barrier before each phase
    spans = start[1:] - start[:-1]
    parts = []
    for k, name in enumerate(("QKV", "ATTN", "O", "UP", "DOWN")):
        us = float(spans[[fused_decode.PHASES * layer + k for layer in range(1, c.num_hidden_layers)]].mean())
        parts.append({"phase": name, "us / layer": round(us, 2)})
    parts.append({"phase": "LM (lm_head)", "us / layer": round(float(t[:, -1, 1].max() - start[-1]), 1)})
    k = dec.kernels[4]
    print(f"\nfused decoding: random SDAR-{args.shape} bf16, batch 1, against {n} cached tokens, "
          f"{torch.cuda.get_device_name()}; roofline {roofline_ms:.3f} ms per forward; one CUDA-graph replay per "
          f"forward, median of {args.repeats}; kernel: {dec.programs} blocks of {32 * (fused_decode.CW + 1)} threads, "
          f"{k['kernel'].num_regs} registers, {k['kernel'].local_size_bytes} B local memory, a ring of "
          f"{k['stages']} stages of 16 x {fused_decode.KC} weights (4-row kernel)")
    print(table(rows))
    print("\nwhere a 4-token forward's time goes (the kernel's timestamps; barrier exit to barrier exit):")
    print(table(parts))
    new_chunk = n // -(-(n + 4 + dec.slack) // dec.nchunks)   # the chunk holding the first new slot (attention_chunk)
    steps, attn = phase_detail(details, c.num_hidden_layers, dec.nchunks, c.num_key_value_heads, new_chunk)
    print("\ninside the phases (the kernel built with TRACE, 3 launches; us, medians over blocks, means over "
          "layers 1-27; the global timer may tick in 1 us steps, so entries under 1 us only say 'short'):")
    print(table(steps))
    print(table(attn))
