"""Benchmarks on random SDAR-shaped models (GPU): `python -m dice.bench sample|profile|fused|train|model|verify|stability|rules|rl|builds|check`.

Every number is a median over repeated runs after warm-up; each table names the roofline it is
compared with (`common`: H200 HBM 4.8 TB/s, bf16 dense matmul 790 TFLOP/s). Current numbers, with
their commands and hardware: `dice/PERFORMANCE.md`.

| module | command |
| --- | --- |
| `decode` | `sample` (tokens/s vs the weight roofline), `profile` (a batch-1 forward, kernel by kernel) |
| `fused_decode` | `fused` (the persistent kernel of `dice.fused` vs the compiled step) |
| `training` | `train` (SFT step, MFU, FSDP2), `model` (numerics: bf16 vs fp32, flex vs dense, cache vs brute force) |
| `verify`, `references` | `verify` (verifier throughput), `verify --check` (reference solutions through the verifier) |
| `build_cost` | `builds` (load_inline fast-build CPU per program, generic vs torch's binding; no GPU needed) |
| `stability` | `stability` (honest candidates' speedups from fresh Verifiers: do they repeat?) |
| `reward_rules` | `rules` (the same programs under DICE's reward and ours: what DICE's lets through, by reason) |
| `rl_step`, `rl_setup`, `replay` | `rl` (one BiC-RL step, DICE's 64 x 16 on request: generate / verify / update seconds, update TFLOP/s, the bound; torchrun: FSDP2 over N GPUs) |
| `suite` | `check` (the GPU test suite and the headline numbers above in one call, one table last) |
"""
from __future__ import annotations

import os
import sys

import torch

from ..cli import ArgumentParser, at_least
from ..model.sdar import SDAR_SHAPES
from . import build_cost, decode, fused_decode, reward_rules, rl_step, stability, suite, training
from .common import BenchRun, BudgetSpent, add_run_arguments
from .training import train_shape
from .verify import main as verify_main


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m dice.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sample", help="decoding tokens/s vs autoregressive and the roofline")
    s.add_argument("--shape", type=str.lower, choices=SDAR_SHAPES, default="1.7b", help="public SDAR shape")
    s.add_argument("--gen", type=at_least(1), default=1024, help="new tokens per sequence")
    s.add_argument("--prompt-len", type=at_least(1), default=128, help="prompt tokens")
    s.add_argument("--batch", type=at_least(1), nargs="+", default=[1, 64], help="batch sizes to run")
    s.add_argument("--repeats", type=at_least(1), default=3, help="timed runs per row (median)")
    s.add_argument("--eager-gen", type=at_least(1), default=128, help="tokens for the (slow) eager batch-1 row")
    s.add_argument("--compile-batch", type=at_least(1), nargs="*", default=[1], help="batches also run with compile=True")
    s.add_argument("--fused", action="store_true", help="also run batch 1 with the fused decoding kernel (Hopper)")
    pr = sub.add_parser("profile", help="where a batch-1 decode forward spends its time; decode attention vs SDPA")
    pr.add_argument("--shape", type=str.lower, choices=SDAR_SHAPES, default="1.7b", help="public SDAR shape")
    pr.add_argument("--cache-len", type=at_least(1), default=1024, help="cached tokens the decode step attends to")
    pr.add_argument("--repeats", type=at_least(1), default=50, help="timed CUDA-graph replays (median)")
    pr.add_argument("--no-compile", action="store_true", help="eager decoder layers")
    pr.add_argument("--max-autotune", action="store_true", help="let Inductor pick Triton or cuBLAS per product shape")
    fz = sub.add_parser("fused", help="the persistent fused decoding kernel vs the compiled layer-by-layer step")
    fz.add_argument("--shape", type=str.lower, choices=SDAR_SHAPES, default="1.7b", help="public SDAR shape")
    fz.add_argument("--cache-len", type=at_least(1), default=1024, help="cached tokens the decode step attends to")
    fz.add_argument("--repeats", type=at_least(1), default=50, help="timed CUDA-graph replays (median)")
    t = sub.add_parser("train", help="SFT step time, tokens/s, memory and MFU (torchrun: FSDP2 over N GPUs)")
    t.add_argument("--shape", type=train_shape, default="1.7b",
                   help="1.7b, 4b, 8b, or a model folder whose config.json to use")
    t.add_argument("--seq-len", type=at_least(1), default=4096, help="tokens per row (doubled to [x_t ; x_0])")
    t.add_argument("--batch", type=at_least(1), default=1, help="rows per process")
    t.add_argument("--steps", type=at_least(1), default=5, help="timed steps (median)")
    t.add_argument("--warmup", type=at_least(0), default=2, help="untimed steps first")
    t.add_argument("--grad-ckpt", action="store_true",
                   help="recompute each layer's forward in the backward pass (adds an HFU column)")
    m = sub.add_parser("model", help="bf16 vs fp32 logits, flex vs dense attention")
    m.add_argument("--shape", type=str.lower, choices=SDAR_SHAPES, default="1.7b", help="public SDAR shape")
    suite.add_arguments(sub.add_parser("check", help="the GPU test suite and the headline benchmarks in one call "
                                                     "(from a checkout)"))
    build_cost.add_arguments(sub.add_parser("builds", help="load_inline fast-build CPU per program, generic vs torch's "
                                                       "binding (no GPU needed)"))
    stability.add_arguments(sub.add_parser("stability", help="the same candidates' speedups from fresh Verifiers"))
    reward_rules.add_arguments(sub.add_parser("rules", help="the same programs judged by DICE's reward and ours: "
                                                            "what DICE's lets through"))
    rl_step.add_arguments(sub.add_parser("rl", help="one BiC-RL step: generate / verify / update time, the bound"))
    # verify's flags live in bench_verify, which parses (and lists with --help) everything after "verify"
    sub.add_parser("verify", add_help=False, help="kernels verified per minute (CuPy vs load_inline), or --check")
    for name, sub_parser in sub.choices.items():
        if name != "verify":
            add_run_arguments(sub_parser)
    sub.choices["check"].set_defaults(budget_s=540.0)   # the whole check in one 10-minute call
    args, rest = parser.parse_known_args(argv)
    if args.what == "verify":
        verify_main(rest)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    benches = {"sample": decode.bench_sample, "profile": decode.bench_profile, "fused": fused_decode.bench_fused,
               "train": training.bench_train, "model": training.bench_model, "stability": stability.bench_stability,
               "rules": reward_rules.bench_rules,
               "rl": rl_step.bench_rl, "builds": build_cost.bench_builds, "check": suite.bench_check}
    # rl (with --reward python) and builds (compiles only) run on a CPU too
    if not torch.cuda.is_available() and args.what not in ("train", "rl", "builds"):
        sys.exit(f"error: python -m dice.bench {args.what} needs a CUDA GPU, which this machine lacks; run it on a GPU "
                 "machine (rl --reward python and builds run on a CPU too)")
    if not torch.cuda.is_available() and args.what == "train":
        print("note: dice.bench train is meant for a CUDA GPU; this machine has none, so it runs on the CPU "
              "(slow for the SDAR shapes)", file=sys.stderr)
    # under torchrun rank 0 alone reports (torchrun sets RANK)
    bench = BenchRun(args.what, args.budget_s, args.out, shown=os.environ.get("RANK", "0") == "0")
    try:
        benches[args.what](args, bench)
    except BudgetSpent:
        pass
    finally:
        bench.finish()
