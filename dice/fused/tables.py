"""The TRACE build of the fused kernel, read back: the tables of `python -m dice.bench fused`.

`fused_decode.cu` built with `#define TRACE` records, per block and phase, 8 more slots beside the
two timestamps of every build (it says which); `phase_detail` turns them into rows."""
from __future__ import annotations

from .decoder import PHASES


def phase_detail(details, layers: int, nchunks: int, kv_heads: int,
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
