"""Benchmarks on random SDAR-shaped models (GPU): `python -m dice.bench sample|profile|fused|train|verify|model`.

Every number is a median over repeated runs after warm-up; each table names the roofline it is
compared with. H200 ceilings used (measured on this project's machine kind, see README):
HBM 4.8 TB/s (datasheet; ~4.3 TB/s measured copy), bf16 dense matmul 790 TFLOP/s.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from .cli import ArgumentParser
from .model import SDAR, SDAR_SHAPES, flops_per_token, sdar_shape

HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS = 790e12


def random_model(shape: str, device="cuda", dtype=torch.bfloat16, seed: int = 0, peaked: float = 1.0, **overrides):
    """A random-weight SDAR of a public shape; `peaked` scales lm_head so that outputs are confident."""
    with torch.device("meta"):
        model = SDAR(sdar_shape(shape, **overrides))
    model = model.to_empty(device=device).tie_weights().float().init_weights(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(peaked)
    return model.to(dtype).eval()


def forward_weight_bytes(model) -> int:
    """Bytes of weights one decode forward reads: every matrix except the embedding table,
    of which only the looked-up rows are read (lm_head is read in full, tied or not)."""
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    untied = model.lm_head.weight is not embed
    return total - (embed.numel() * embed.element_size() if untied else 0)


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    line = lambda vals: "  ".join(str(v).rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(keys), *(line([r[k] for k in keys]) for r in rows)])


def bench_sample(args) -> None:
    """Block-diffusion decoding vs autoregressive decoding with the same cache code, vs the
    weight-bandwidth roofline (weights bytes / 4.8 TB/s per forward)."""
    from .sampler import generate
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64     # one compilation per (batch, tokens, cache length)
    model = random_model(args.shape)
    roofline_fps = HBM_BYTES_PER_S / forward_weight_bytes(model)
    prompt = torch.randint(0, 150000, (args.prompt_len,)).tolist()
    rows = []

    def run(label, batch, block_size, steps, graphs, remasking="low_confidence_static", m=model, compile=False,
            gen=args.gen, repeats=args.repeats, fused=False):
        saved = m.config.block_size
        m.config.block_size = block_size
        try:
            kw = dict(max_new_tokens=gen, steps_per_block=steps, remasking=remasking, cuda_graphs=graphs,
                      compile=compile, fused=fused)
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
        rows.append({"decode": label, "batch": batch, "gen": gen, "graphs": graphs, "compile": compile, "fused": fused,
                     "tokens/s": round(res.num_tokens / t), "forwards": res.forwards,
                     "ms/forward": round(1e3 / fps, 3), "% roofline fwd/s": round(100 * fps / roofline_fps, 1)})
        print(table(rows[-1:]), file=sys.stderr, flush=True)

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
    print(table(rows))


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


def median_replay_ms(graph, repeats: int) -> float:
    """Median milliseconds of `repeats` replays of a CUDA graph, each bracketed by CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_profile(args) -> None:
    """Where one batch-1 decode forward spends its time: CUDA-graph replays of the block step
    (4 new tokens against a cache of `--cache-len`, compiled layers unless --no-compile) timed
    with CUDA events, then profiled; kernels are grouped by `kernel_group`, and
    replay time minus kernel time is the gaps between the ~500 kernels of a forward."""
    from .sampler import CachedForward
    if args.max_autotune:
        # Inductor times its Triton matmul templates against cuBLAS for each product shape and
        # keeps the faster: a test of whether cuBLAS's 4-row products leave bandwidth unused
        from torch._inductor import config as inductor_config
        inductor_config.max_autotune_gemm = True
        inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    torch.manual_seed(0)
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
    print(f"\ndecode attention per layer, {T} queries x {n + 2 * T} keys, {model.config.num_hidden_layers} "
          f"layers' K/V in one compiled CUDA graph:")
    print(table(decode_attention_rows(model.config, n + 2 * T, T)))
    print(f"\ndecode matrix products, {T} rows, each shape one CUDA graph over every layer's own weight:")
    print(table(decode_product_rows(model, T)))


def bench_fused(args) -> None:
    """The persistent fused decoding kernel (`dice.fused_decode`) against the compiled
    layer-by-layer step: CUDA-graph replays of one block step (T new tokens against a cache of
    `--cache-len`), medians of `--repeats`, the relative error of its logits against the
    layer-by-layer step's, and where a forward's time goes (the kernel's own timestamps: for each
    phase kind, the mean time from one grid barrier's exit to the next, over layers 1-27)."""
    from . import fused_decode
    from .sampler import CachedForward
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
                step = CachedForward(model, prefilled(), True, compile=name.startswith("compiled"),
                                     fused=name.startswith("fused"))
                step(*new, 0, lf)
                ms = median_replay_ms(next(iter(step.graphs.values()))["graph"], args.repeats)
                rows.append({"step": name, "new tokens": T, "ms / forward": round(ms, 3),
                             "% of roofline": round(100 * roofline_ms / ms, 1), "rel. error vs layers": "-"})
                print(table(rows[-1:]), file=sys.stderr, flush=True)
            dec, cache = step.fused, step.cache      # the loop's last step: the fused kernel
            slots = torch.arange(n, n + T, device="cuda")
            ref = model.step_logits(*new, prefilled(), slots, n + T, lf).float()
            got = dec.step_logits(*new, cache, slots, n + T, lf).float()
            rows[-1]["rel. error vs layers"] = f"{((got - ref).norm() / ref.norm()).item():.1e}"
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
    steps, attn = fused_phase_detail(details, c.num_hidden_layers, dec.nchunks, c.num_key_value_heads, new_chunk)
    print("\ninside the phases (the kernel built with TRACE, 3 launches; us, medians over blocks, means over "
          "layers 1-27; the global timer may tick in 1 us steps, so entries under 1 us only say 'short'):")
    print(table(steps))
    print(table(attn))


def fused_phase_detail(details, layers: int, nchunks: int, kv_heads: int,
                       new_chunk: int) -> tuple[list[dict], list[dict]]:
    """Rows of `bench fused`'s inside-the-phases tables from (trace, detail) pairs of the TRACE
    build (slots: fused_decode.cu): per matrix phase the prologue after the barrier, the wait for
    the first stage, the block's stages (and the slowest block's), the tail, the wait at the next
    barrier and the share of the phase's clock cycles spent waiting for stages (thread 0), and the
    SM clock (the phase's cycles over its nanoseconds); for attention (the blocks with a work item)
    the queries and new keys, the wait for the piece's keys and values, the scores, the softmax and
    value product (these three from clock cycles, summed over pieces), the ticket, the slowest of
    a head's blocks to take its ticket and the block holding the new tokens (chunk `new_chunk`: it
    also norms and writes their keys; both from the barrier's exit), the head's merge (its last
    block) and the wait at the next barrier."""
    from .fused_decode import PHASES

    def med(x):
        return float(x.median()) / 1e3
    steps = []
    for k, name in ((0, "QKV"), (2, "O"), (3, "UP"), (4, "DOWN")):
        cols = {key: [] for key in ("prologue", "first stage", "stages", "slowest stages", "tail", "barrier wait",
                                    "waiting share", "SM GHz")}
        for t, d in details:
            for layer in range(1, layers):
                p = PHASES * layer + k
                has = d[:, p, 7] > 0                          # blocks with a tile in this phase
                start, end, nxt, dp = t[has, p, 0], t[has, p, 1], t[has, p + 1, 0], d[has, p]
                cols["prologue"].append(med(dp[:, 0] - start))
                cols["first stage"].append(med(dp[:, 1] - dp[:, 0]))
                cols["stages"].append(med(dp[:, 2] - dp[:, 1]))
                cols["slowest stages"].append(float((dp[:, 2] - dp[:, 1]).max()) / 1e3)
                cols["tail"].append(med(end - dp[:, 2]))
                cols["barrier wait"].append(med(nxt - end))
                cols["waiting share"].append(float((dp[:, 3] / dp[:, 6]).median()))
                cols["SM GHz"].append(float((dp[:, 6] / (end - start)).median()))
        steps.append({"phase": name, **{key: round(sum(v) / len(v), 2) for key, v in cols.items()}})
    cols = {key: [] for key in ("queries, new keys", "K/V wait", "scores", "softmax, values", "ticket",
                                "last ticket", "new tokens' ticket", "merge", "barrier wait")}
    items = nchunks * kv_heads                           # the blocks with an attention item, head by head
    for t, d in details:
        for layer in range(1, layers):
            p = PHASES * layer + 1
            start, end, nxt, dp = t[:items, p, 0], t[:items, p, 1], t[:items, p + 1, 0], d[:items, p]
            us_per_cycle = (end - start) / dp[:, 6] / 1e3    # the block's phase in ns over its cycles
            merge = (end - dp[:, 2]).reshape(-1, nchunks).max(1).values
            cols["queries, new keys"].append(med(dp[:, 0] - start))
            for slot, key in ((3, "K/V wait"), (4, "scores"), (5, "softmax, values")):
                cols[key].append(float((dp[:, slot] * us_per_cycle).median()))
            cols["ticket"].append(med(dp[:, 2] - dp[:, 1]))
            cols["last ticket"].append(med((dp[:, 2] - start).reshape(-1, nchunks).max(1).values))
            cols["new tokens' ticket"].append(med((dp[:, 2] - start).reshape(-1, nchunks)[:, new_chunk]))
            cols["merge"].append(med(merge))
            cols["barrier wait"].append(med(nxt - end))
    attn = [{"phase": "ATTN", **{key: round(sum(v) / len(v), 2) for key, v in cols.items()}}]
    return steps, attn


def decode_attention_rows(cfg, kv_len: int, T: int) -> list[dict]:
    """`attend` (explicit products for a decoding step) vs SDPA given the same folded bias, each
    compiled and replayed as one CUDA graph over every layer's own K/V (so L2 holds none of it)."""
    import torch.nn.functional as F
    from .attention import attend, folded_attention_bias
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
    import torch.nn.functional as F
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


def train_shape(text: str) -> str:
    """`bench train --shape`: a public SDAR shape or a model folder with a config.json."""
    if text.lower() in SDAR_SHAPES or (Path(text) / "config.json").is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a shape ({', '.join(SDAR_SHAPES)}) nor a model folder "
                                     "with a config.json")


def model_config(shape: str):
    """A public SDAR shape ("1.7b", "4b", "8b") or the config.json of a model folder."""
    from .checkpoint import read_config
    return read_config(shape) if Path(shape).is_dir() else sdar_shape(shape)


def bench_train(args) -> None:
    """SFT steps of a random SDAR-shaped model: step time, tokens/s, peak memory, MFU; under
    `torchrun --nproc_per_node N` sharded with FSDP2 (as `train.py`), `--batch` rows per process.

    FLOPs per step = 6 * (layer matmul params) * 2n  (forward + backward, every token of [x_t ; x_0])
                   + 6 * d * V * masked              (lm_head on masked positions only)
                   + 12 * layers * heads * head_dim * visible (q, k) pairs of the block-diffusion mask
    per row, over all processes' rows. MFU = FLOPs / step time / (N x 790 TFLOP/s, the bf16 matmul
    rate measured on the H200). With --grad-ckpt the layers' forward runs twice; HFU (hardware FLOPs
    utilisation) also counts that recompute, a third of the layer and attention terms. The step time
    is the slowest process's; tokens/s per process at N processes over that at 1 is the scaling
    efficiency.
    """
    from .attention import block_diffusion_mask
    from .diffusion import diffusion_loss
    from .trainer import TrainConfig, make_optimizer, setup_runtime, shard
    rt = setup_runtime()
    cuda = rt.device.type == "cuda"
    torch.manual_seed(0)
    cfg_model = model_config(args.shape)
    n = args.seq_len
    with torch.device("meta"):
        model = SDAR(cfg_model)
    model = model.to_empty(device=rt.device).tie_weights().init_weights(seed=0).train()
    model.gradient_checkpointing = args.grad_ckpt
    if rt.world > 1:
        shard(model)
    opt = make_optimizer(model, TrainConfig(lr=1e-5))
    prompt = n // 8
    ids = torch.randint(0, cfg_model.vocab_size - 1, (1, n))
    ids += (ids >= cfg_model.mask_token_id).long()              # every id but the mask token
    row = {"input_ids": ids, "position_ids": torch.arange(n)[None],
           "sample_ids": torch.zeros(1, n, dtype=torch.long), "loss_mask": (torch.arange(n) >= prompt)[None]}
    batch = {k: v.repeat(args.batch, 1) for k, v in row.items()}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for i in range(args.warmup + args.steps):
        gens = [torch.Generator().manual_seed((i * rt.world + rt.rank) * args.batch + j) for j in range(args.batch)]
        sync()
        t0 = time.perf_counter()
        with torch.autocast(rt.device.type, dtype=torch.bfloat16):
            loss = diffusion_loss(model, batch, gens, cfg_model.mask_token_id, use_flex=cuda)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append(rt.all_max(time.perf_counter() - t0))
    t = statistics.median(times)
    rows = rt.world * args.batch
    layer_params = cfg_model.num_parameters(include_embedding=False)
    visible = int(block_diffusion_mask(torch.arange(n), cfg_model.block_size).sum())
    masked = int((n - prompt) * 0.5)  # E[p] = 1/2 of the response is masked
    layer_flops = 6 * layer_params * 2 * n + 12 * cfg_model.num_hidden_layers * cfg_model.num_attention_heads \
        * cfg_model.head_dim * visible
    flops = rows * (layer_flops + 6 * cfg_model.hidden_size * cfg_model.vocab_size * masked)
    recompute = rows * layer_flops // 3 if args.grad_ckpt else 0   # each layer's forward again in backward
    dense_6nd = rows * 2 * n * flops_per_token(cfg_model, 2 * n)
    peak = rt.all_max(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
    if rt.rank != 0:
        return
    where = torch.cuda.get_device_name() if cuda else "CPU (MFU is against the H200's rate: not meaningful here)"
    print(f"\ntrain bench: random SDAR-{args.shape}, bf16 autocast + fp32 master weights, AdamW, "
          f"{'FlexAttention' if cuda else 'dense masks'}, {rt.world} process(es) x batch {args.batch} x {n} tokens "
          f"({2 * n} doubled){', FSDP2' if rt.world > 1 else ''}, grad ckpt {args.grad_ckpt}, {where}")
    row = {"processes": rt.world, "step ms": round(t * 1e3, 1), "tokens/s": round(rows * n / t),
           "tokens/s per process": round(args.batch * n / t), "doubled tokens/s": round(rows * 2 * n / t),
           "peak GiB (max rank)": round(peak, 1), "TFLOP/step": round(flops / 1e12, 1),
           "MFU %": round(100 * flops / t / (rt.world * BF16_FLOPS), 1),
           "MFU % (dense 6ND+attn)": round(100 * dense_6nd / t / (rt.world * BF16_FLOPS), 1)}
    if args.grad_ckpt:
        row["HFU % (with recompute)"] = round(100 * (flops + recompute) / t / (rt.world * BF16_FLOPS), 1)
    print(table([row]))


def bench_model(args) -> None:
    """bf16 GPU logits vs the float32 CPU path, and FlexAttention vs dense training forward."""
    from .attention import block_diffusion_mask, flex_block_diffusion_mask
    gpu32 = random_model(args.shape, dtype=torch.float32)
    cpu32 = random_model(args.shape, dtype=torch.float32)
    cpu32.load_state_dict(gpu32.state_dict())
    cpu32 = cpu32.cpu()
    gpu16 = gpu32.to(torch.bfloat16)
    ids = torch.randint(0, 150000, (2, 37))
    with torch.no_grad():
        ref = cpu32(ids).double()
        got = gpu16(ids.cuda()).double().cpu()
        n = 512
        tokens = torch.randint(0, 150000, (1, 2 * n), device="cuda")
        pos = torch.arange(n, device="cuda")[None]
        doubled_pos = torch.cat([pos, pos], 1)
        dense = gpu16(tokens, doubled_pos, block_diffusion_mask(pos, 4)).double()
        flex = gpu16(tokens, doubled_pos, flex_block_diffusion_mask(pos, 4)).double()
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    print(f"\nmodel check: random SDAR-{args.shape}")
    print(table([{"check": "bf16 GPU vs fp32 CPU logits", "rel err (norm)": f"{rel(got, ref):.2e}",
                  "max abs / max|ref|": f"{float((got - ref).abs().max() / ref.abs().max()):.2e}"},
                 {"check": "flex vs dense training fwd (bf16)", "rel err (norm)": f"{rel(flex, dense):.2e}",
                  "max abs / max|ref|": f"{float((flex - dense).abs().max() / dense.abs().max()):.2e}"}]))
    del gpu32, cpu32, gpu16
    print(f"\ncached (CUDA graphs) vs brute-force greedy decoding, random SDAR-{args.shape}, "
          f"3 prompts of 16/21/30 tokens, 48 new tokens each")
    print(table(cache_divergence(args.shape)))


def cache_divergence(shape: str) -> list[dict]:
    """Where greedy cached decoding first departs from the no-cache brute force, per dtype and
    remasking: bf16 rounds differently in a 4-token step than in a full recompute, so near-ties
    can flip; float32 must agree exactly."""
    from .sampler import generate
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in (16, 21, 30)]
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        model = random_model(shape, dtype=dtype, peaked=12.0)
        for remasking in ("low_confidence_static", "low_confidence_dynamic"):
            kw = dict(max_new_tokens=48, remasking=remasking)
            cached, brute = generate(model, prompts, **kw), generate(model, prompts, use_cache=False, **kw)
            first = [next((i for i, (a, b) in enumerate(zip(c, r)) if a != b), None)
                     for c, r in zip(cached.tokens, brute.tokens)]
            same = sum(a == b for c, r in zip(cached.tokens, brute.tokens) for a, b in zip(c, r))
            rows.append({"dtype": str(dtype).replace("torch.", ""), "remasking": remasking,
                         "tokens equal": f"{same}/{sum(map(len, brute.tokens))}",
                         "step maps equal": cached.step_map == brute.step_map,
                         "first divergence per prompt": str(first)})
        del model
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m dice.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sample", help="decoding tokens/s vs autoregressive and the roofline")
    s.add_argument("--shape", type=str.lower, choices=SDAR_SHAPES, default="1.7b", help="public SDAR shape")
    s.add_argument("--gen", type=int, default=1024, help="new tokens per sequence")
    s.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    s.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="batch sizes to run")
    s.add_argument("--repeats", type=int, default=3, help="timed runs per row (median)")
    s.add_argument("--eager-gen", type=int, default=128, help="tokens for the (slow) eager batch-1 row")
    s.add_argument("--compile-batch", type=int, nargs="*", default=[1], help="batches also run with compile=True")
    s.add_argument("--fused", action="store_true", help="also run batch 1 with the fused decoding kernel (Hopper)")
    pr = sub.add_parser("profile", help="where a batch-1 decode forward spends its time; decode attention vs SDPA")
    pr.add_argument("--shape", type=str.lower, choices=SDAR_SHAPES, default="1.7b", help="public SDAR shape")
    pr.add_argument("--cache-len", type=int, default=1024, help="cached tokens the decode step attends to")
    pr.add_argument("--repeats", type=int, default=50, help="timed CUDA-graph replays (median)")
    pr.add_argument("--no-compile", action="store_true", help="eager decoder layers")
    pr.add_argument("--max-autotune", action="store_true", help="let Inductor pick Triton or cuBLAS per product shape")
    fz = sub.add_parser("fused", help="the persistent fused decoding kernel vs the compiled layer-by-layer step")
    fz.add_argument("--shape", type=str.lower, choices=SDAR_SHAPES, default="1.7b", help="public SDAR shape")
    fz.add_argument("--cache-len", type=int, default=1024, help="cached tokens the decode step attends to")
    fz.add_argument("--repeats", type=int, default=50, help="timed CUDA-graph replays (median)")
    t = sub.add_parser("train", help="SFT step time, tokens/s, memory and MFU (torchrun: FSDP2 over N GPUs)")
    t.add_argument("--shape", type=train_shape, default="1.7b",
                   help="1.7b, 4b, 8b, or a model folder whose config.json to use")
    t.add_argument("--seq-len", type=int, default=4096, help="tokens per row (doubled to [x_t ; x_0])")
    t.add_argument("--batch", type=int, default=1, help="rows per process")
    t.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    t.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    t.add_argument("--grad-ckpt", action="store_true",
                   help="recompute each layer's forward in the backward pass (adds an HFU column)")
    m = sub.add_parser("model", help="bf16 vs fp32 logits, flex vs dense attention")
    m.add_argument("--shape", type=str.lower, choices=SDAR_SHAPES, default="1.7b", help="public SDAR shape")
    # verify's flags live in bench_verify, which parses (and lists with --help) everything after "verify"
    sub.add_parser("verify", add_help=False, help="kernels verified per minute (CuPy vs load_inline), or --check")
    args, rest = parser.parse_known_args(argv)
    if args.what == "verify":
        from .bench_verify import main as verify_main
        verify_main(rest)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if not torch.cuda.is_available() and args.what != "train":
        sys.exit("python -m dice.bench needs a CUDA GPU; this machine has none")
    if not torch.cuda.is_available():
        print("note: dice.bench train is meant for a CUDA GPU; this machine has none, so it runs on the CPU "
              "(slow for the SDAR shapes)", file=sys.stderr)
    {"sample": bench_sample, "profile": bench_profile, "fused": bench_fused, "train": bench_train,
     "model": bench_model}[args.what](args)


if __name__ == "__main__":
    main()
