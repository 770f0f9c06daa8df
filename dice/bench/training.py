"""Training and model benchmarks: `python -m dice.bench train` (the SFT step, FSDP2 over N GPUs under
torchrun: step time, tokens/s, memory, MFU) and `python -m dice.bench model` (bf16 against float32
logits, FlexAttention against dense masks, cached against brute-force decoding)."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ..config import TrainConfig
from ..model.attention import block_diffusion_mask, flex_block_diffusion_mask
from ..model.checkpoint import read_config
from ..model.sdar import SDAR, SDAR_SHAPES, flops_per_token, random_model, sdar_shape
from ..runtime import make_optimizer, setup_runtime, shard
from ..sampling.sampler import Engine, Sampling, generate
from ..sft.diffusion import diffusion_loss
from .common import BF16_FLOPS, table


def train_shape(text: str) -> str:
    """`bench train --shape`: a public SDAR shape or a model folder with a config.json."""
    if text.lower() in SDAR_SHAPES or (Path(text) / "config.json").is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a shape ({', '.join(SDAR_SHAPES)}) nor a model folder "
                                     "with a config.json")


def model_config(shape: str):
    """A public SDAR shape ("1.7b", "4b", "8b") or the config.json of a model folder."""
    return read_config(shape) if Path(shape).is_dir() else sdar_shape(shape)


def bench_train(args, bench) -> None:
    """SFT steps of a random SDAR-shaped model: step time, tokens/s, peak memory, MFU; under
    `torchrun --nproc_per_node N` sharded with FSDP2 (as `train.py`), `--batch` rows per process.

    FLOPs per step = 6 * (layer matmul params) * 2n  (forward + backward, every token of [x_t ; x_0])
                   + 6 * d * V * masked              (lm_head on masked positions only)
                   + 12 * layers * heads * head_dim * visible (q, k) pairs of the block-diffusion mask
    per row, over all processes' rows (the steps run whole: under torchrun no process may stop
    alone, so the budget is not checked between them). MFU = FLOPs / step time / (N x 790 TFLOP/s, the bf16 matmul
    rate measured on the H200). With --grad-ckpt the layers' forward runs twice; HFU (hardware FLOPs
    utilisation) also counts that recompute, a third of the layer and attention terms. The step time
    is the slowest process's; tokens/s per process at N processes over that at 1 is the scaling
    efficiency.
    """
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
        if rt.main:
            bench.progress("warm-up steps" if i < args.warmup else "timed steps", i + 1, args.warmup + args.steps)
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
    bench.row(row)


def bench_model(args, bench) -> None:
    """bf16 GPU logits vs the float32 CPU path, and FlexAttention vs dense training forward."""
    bench.progress("bf16 vs fp32 logits, flex vs dense")
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
    bench.check("cached vs brute-force decoding")
    bench.progress("cached vs brute-force decoding")
    print(f"\ncached (CUDA graphs) vs brute-force greedy decoding, random SDAR-{args.shape}, "
          f"3 prompts of 16/21/30 tokens, 48 new tokens each")
    print(table(cache_divergence(args.shape)))


def cache_divergence(shape: str) -> list[dict]:
    """Where greedy cached decoding first departs from the no-cache brute force, per dtype and
    remasking: bf16 rounds differently in a 4-token step than in a full recompute, so near-ties
    can flip; float32 must agree exactly."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in (16, 21, 30)]
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        model = random_model(shape, dtype=dtype, peaked=12.0)
        for remasking in ("low_confidence_static", "low_confidence_dynamic"):
            kw = dict(max_new_tokens=48, sampling=Sampling(remasking=remasking))
            cached = generate(model, prompts, **kw)
            brute = generate(model, prompts, engine=Engine(use_cache=False), **kw)
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
