"""Decoding benchmarks (GPU): `python -m dice.bench sample` (tokens/s against the weight roofline)
and `python -m dice.bench profile` (where a batch-1 decode forward spends its time)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config

from ..model.attention import attend, folded_attention_bias
from ..model.sdar import random_model
from ..sampling.sampler import CachedForward, Engine, Sampling, generate
from .common import HBM_BYTES_PER_S, forward_weight_bytes, median_replay_ms, table


def bench_sample(args, bench) -> None:
    """Block-diffusion decoding vs autoregressive decoding with the same cache code, vs the
    weight-bandwidth roofline (weights bytes / 4.8 TB/s per forward)."""
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64     # one compilation per (batch, tokens, cache length)
    model = random_model(args.shape)
    roofline_fps = HBM_BYTES_PER_S / forward_weight_bytes(model)
    prompt = torch.randint(0, 150000, (args.prompt_len,)).tolist()

    def run(label, batch, block_size, steps, graphs, remasking="low_confidence_static", m=model, compile=False,
            gen=args.gen, repeats=args.repeats, fused=False):
        what = f"{label}, batch {batch}, graphs {graphs}, compile {compile}, fused {fused}"
        bench.check(what)
        bench.progress(what)
        saved = m.config.block_size
        m.config.block_size = block_size
        try:
            kw = dict(max_new_tokens=gen, sampling=Sampling(steps_per_block=steps, remasking=remasking),
                      engine=Engine(cuda_graphs=graphs, compile=compile, fused=fused))
            # warm-up: graph capture; compiled steps depend on the cache length, so warm up at full length
            generate(m, [prompt] * batch, **{**kw, "max_new_tokens": gen if compile else 64})
            times, res = [], None
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = generate(m, [prompt] * batch, **kw)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        finally:
            m.config.block_size = saved
        t = statistics.median(times)
        fps = res.forwards / t
        bench.row({"decode": label, "batch": batch, "gen": gen, "graphs": graphs, "compile": compile, "fused": fused,
                   "tokens/s": round(res.num_tokens / t), "forwards": res.forwards,
                   "ms/forward": round(1e3 / fps, 3), "% roofline fwd/s": round(100 * fps / roofline_fps, 1)})

    run("diffusion B=4 S=4", 1, 4, 4, False, gen=args.eager_gen)   # eager: what the graphs save
    for batch in args.batch:
        for compile in ([False, True] if batch in args.compile_batch else [False]):
            run("diffusion B=4 S=4", batch, 4, 4, True, compile=compile)
            run("autoregressive", batch, 1, 1, True, compile=compile)
        if batch == 1 and args.fused:
            for compile in (False, True):         # compile: the sampler's own step (the layers are fused)
                run("diffusion B=4 S=4", batch, 4, 4, True, compile=compile, fused=True)
                run("autoregressive", batch, 1, 1, True, compile=compile, fused=True)
    peaked = random_model(args.shape, peaked=12.0)
    for remasking in ("low_confidence_static", "low_confidence_dynamic"):
        run(f"peaked {remasking.split('_')[-1]}", 1, 4, 4, True, remasking, m=peaked)
    print(f"\nsample bench: random SDAR-{args.shape} bf16, prompt {args.prompt_len}, "
          f"{torch.cuda.get_device_name()}; roofline {roofline_fps:.0f} forwards/s "
          f"({forward_weight_bytes(model) / 1e9:.2f} GB weights / 4.8 TB/s)")


def kernel_group(name: str) -> str:
    """matmul / attention / fused (Triton, from torch.compile) / other, from a CUDA kernel's name."""
    name = name.lower()
    if name.startswith("triton"):
        return "fused (triton)"
    if any(k in name for k in ("sdpa", "flash", "fmha")):
        return "attention"
    if any(k in name for k in ("gemm", "nvjet", "splitk", "xmma", "cutlass", "gemv")):
        return "matmul"
    return "other"


def bench_profile(args, bench) -> None:
    """Where one batch-1 decode forward spends its time: CUDA-graph replays of the block step
    (4 new tokens against a cache of `--cache-len`, compiled layers unless --no-compile) timed
    with CUDA events, then profiled; kernels are grouped by `kernel_group`, and
    replay time minus kernel time is the gaps between the ~500 kernels of a forward."""
    if args.max_autotune:
        # Inductor times its Triton matmul templates against cuBLAS for each product shape and
        # keeps the faster: a test of whether cuBLAS's 4-row products leave bandwidth unused
        inductor_config.max_autotune_gemm = True
        inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    torch.manual_seed(0)
    bench.progress("the block step: capture and replays")
    model = random_model(args.shape)
    n, T = args.cache_len, 4
    cache = model.new_cache(1, n + 2 * T)
    step = CachedForward(model, cache, use_graphs=True, compile=not args.no_compile)
    ids = torch.randint(0, 150000, (1, n + T), device="cuda")
    pos = torch.arange(n + T, device="cuda")[None]
    valid = torch.ones(1, n + T, dtype=torch.bool, device="cuda")
    with torch.inference_mode():
        model.forward_cached(ids[:, :n], pos[:, :n], cache, commit=n, valid=valid[:, :n], logits_from=n)
        step(ids[:, n:], pos[:, n:], valid[:, n:], 0, 0)        # captures the graph
        graph = next(iter(step.graphs.values()))["graph"]
        replay_ms = median_replay_ms(graph, args.repeats)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.repeats):
                graph.replay()
            torch.cuda.synchronize()
    busy, calls = {}, 0
    for event in prof.key_averages():
        if event.self_device_time_total <= 0:
            continue
        group = kernel_group(event.key)
        busy[group] = busy.get(group, 0.0) + event.self_device_time_total / 1e3 / args.repeats
        calls += event.count
    rows = [{"part": g, "ms / forward": round(ms, 3), "% of replay": round(100 * ms / replay_ms, 1)}
            for g, ms in sorted(busy.items(), key=lambda kv: -kv[1])]
    gaps = replay_ms - sum(busy.values())
    rows.append({"part": "gaps between kernels", "ms / forward": round(gaps, 3),
                 "% of replay": round(100 * gaps / replay_ms, 1)})
    roofline_ms = forward_weight_bytes(model) / HBM_BYTES_PER_S * 1e3
    print(f"\nprofile: random SDAR-{args.shape} bf16, batch 1, {T} new tokens against {n} cached, "
          f"compile {not args.no_compile}, max-autotune {args.max_autotune}, {torch.cuda.get_device_name()}; replay {replay_ms:.3f} ms "
          f"(median of {args.repeats}), roofline {roofline_ms:.3f} ms, {calls // args.repeats} kernels per forward")
    print(table(rows))
    bench.check("decode attention and matrix products")
    bench.progress("decode attention and matrix products")
    print(f"\ndecode attention per layer, {T} queries x {n + 2 * T} keys, {model.config.num_hidden_layers} "
          f"layers' K/V in one compiled CUDA graph:")
    print(table(decode_attention_rows(model.config, n + 2 * T, T)))
    print(f"\ndecode matrix products, {T} rows, each shape one CUDA graph over every layer's own weight:")
    print(table(decode_product_rows(model, T)))


def decode_attention_rows(cfg, kv_len: int, T: int) -> list[dict]:
    """`attend` (explicit products for a decoding step) vs SDPA given the same folded bias, each
    compiled and replayed as one CUDA graph over every layer's own K/V (so L2 holds none of it)."""
    H, Hkv, D, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    g = H // Hkv
    q = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16)
    kv = [torch.randn(2, 1, Hkv, kv_len, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
    mask = torch.ones(1, 1, T, kv_len, dtype=torch.bool, device="cuda")
    mask[..., kv_len - T:] = False              # the step writes slots [kv_len-2T, kv_len-T); the rest are unfilled
    bias = folded_attention_bias(mask, g, torch.bfloat16)

    def sdpa(q, k, v, bias):
        out = F.scaled_dot_product_attention(q.reshape(1, Hkv, g * T, D), k, v, attn_mask=bias)
        return out.reshape(1, H, T, D)
    rows = []
    for name, fn in (("attend (explicit products)", attend), ("SDPA, same folded bias", sdpa)):
        f = torch.compile(fn, dynamic=False)
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for k, v in kv:
                    f(q, k, v, bias)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for k, v in kv:
                    f(q, k, v, bias)
        rows.append({"attention": name, "us / layer": round(median_replay_ms(graph, 50) * 1e3 / L, 2)})
    return rows


def decode_product_rows(model, T: int) -> list[dict]:
    """Each matrix product of a decode forward on its own: `T` rows times every layer's weight of
    one shape, replayed as one CUDA graph (distinct weights, so each streams from HBM; the lm_head,
    far larger than L2, repeats its one weight). The sum is the forward's product time with no
    attention, norms or gaps; against the weight roofline it bounds what any schedule of these
    kernels can reach."""
    layers = model.model.layers
    shapes = {"qkv_proj": [l.self_attn.qkv_proj.weight for l in layers],
              "o_proj": [l.self_attn.o_proj.weight for l in layers],
              "gate_up_proj": [l.mlp.gate_up_proj.weight for l in layers],
              "down_proj": [l.mlp.down_proj.weight for l in layers],
              "lm_head": [model.lm_head.weight] * len(layers)}
    rows, total_us, total_bytes = [], 0.0, 0
    for name, weights in shapes.items():
        xs = [torch.randn(T, w.shape[1], device="cuda", dtype=w.dtype) for w in weights]
        with torch.inference_mode():
            for x, w in zip(xs, weights):
                F.linear(x, w)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for x, w in zip(xs, weights):
                    F.linear(x, w)
        us = median_replay_ms(graph, 30) * 1e3 / len(weights)
        per_forward = us * (1 if name == "lm_head" else len(layers))
        nbytes = weights[0].numel() * weights[0].element_size()
        total_us += per_forward
        total_bytes += nbytes * (1 if name == "lm_head" else len(layers))
        rows.append({"product": name, "weight MB": round(nbytes / 1e6, 1), "us / call": round(us, 2),
                     "TB/s": round(nbytes / us / 1e6, 2), "ms / forward": round(per_forward / 1e3, 3)})
    rows.append({"product": "all", "weight MB": round(total_bytes / 1e6, 1), "us / call": "",
                 "TB/s": round(total_bytes / total_us / 1e6, 2), "ms / forward": round(total_us / 1e3, 3)})
    return rows
