"""What the benchmarks share: the H200 ceilings, the weight bytes a decode forward reads, CUDA-graph
timing and plain-text tables."""
from __future__ import annotations

import statistics

import torch

HBM_BYTES_PER_S = 4.8e12   # H200 datasheet (~4.3 TB/s measured copy)
BF16_FLOPS = 790e12        # bf16 dense matmul, measured on the H200


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
