"""The model's packed training input for BiC-RL's update: a response's trace rounds beside one clean
stream, packed into micro-batches sized by tokens, and their log-probabilities (DESIGN.md §7).

TraceRL trains every round r of a response on a row of its own, the sequence beside a noisy copy
x_t^r (deadlykitten4/DICE `training/RL/train/rl_sdar.py`, `one_round_vectorized`: [x_0 ; x_t^r]),
so R rounds cost R clean streams. Under the block-diffusion rule (`dice.model.attention`) the clean
stream attends to itself alone and a noisy block to its own block and the clean past, so

    [x_t^1 ; ... ; x_t^R ; x_0]    (`update_rows="response"`)

gives every loss token exactly the log-prob and gradient its own round row gives, and a noisy copy
needs only the blocks that hold its round's loss tokens (no other token of the copy sees them):
a response of n tokens whose block b trains in R_b rounds costs n + sum_b R_b |b| tokens, not
2 n R. `update_rows="round"` builds the rows one per round, the whole sequence in x_t, as SFT's
doubled row [x_t ; x_0] (and the update before the shared stream): the per-round path, for
comparison. Each round row's loss tokens keep the weight `dice.rl.update.row_weights` gave that row.

Micro-batches hold at most `budget` tokens (every copy counted, padding not): groups are placed
largest first into the first micro-batch with room (first-fit decreasing), and a group too large
for the budget is split into groups of fewer rounds, each with its own clean stream. On the
FlexAttention path a micro-batch is one row of packed groups (samples never see each other; the
mask skips the tiles between them) padded to a fixed length (`flex_length`: the budget, or for a
group over it the smallest multiple of the budget), so that compiled FlexAttention, which compiles
once per shape, compiles in a process's first update and not after (`CompileClock` counts those
seconds); the dense path gives every group its own row, unpadded, since a dense mask grows with the
square of the row.

An RL step's update (`dice.rl.update.update_plan`) cuts its round rows into the optimiser steps'
minibatches and each step's rows into these micro-batches; this module is its tensor plumbing, and
the sizes its budget is planned from (`group_bound`, `dice.memory.UpdateTokens`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from ..config import UPDATE_ROWS
from ..sampling.completion import Completion
from .attention import flex_streams_mask, streams_mask
from .sdar import compute_device


@dataclass
class Round:
    """One trace round of a response (`dice.rl.update.trace_rounds`): what its noisy copy masks and
    where its loss counts."""
    masked: list[int]      # positions (in prompt + response) that are MASK in the noisy copy
    loss: list[int]        # positions whose loss counts (unmasked at this round's step)
    index: int             # r: the response's round rows in order


@dataclass
class RoundGroup:
    """Rounds of the response `k` that share one clean stream: round i's loss tokens weigh
    weights[i] and its noisy copy holds the blocks copies[i] (those of its loss tokens, or with
    `whole` every block); `tokens` counts the clean stream and every copy."""
    k: int
    completion: Completion
    block_size: int
    whole: bool = False
    rounds: list[Round] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    copies: list[list[int]] = field(default_factory=list)
    length: int = field(init=False)    # of the clean stream: prompt, response and tail
    tokens: int = field(init=False)

    def __post_init__(self):
        c = self.completion
        self.length = len(c.prompt_ids) + len(c.tokens) + len(c.tail_tokens)
        self.tokens = self.length + sum(self._size(blocks) for blocks in self.copies)

    def _size(self, blocks: list[int]) -> int:
        """Tokens of the (sorted) blocks: all full but one the sequence ends in."""
        if not blocks:
            return 0
        return len(blocks) * self.block_size - max(0, (blocks[-1] + 1) * self.block_size - self.length)

    def copy_of(self, rnd: Round) -> tuple[list[int], int]:
        """The blocks of round `rnd`'s noisy copy and their tokens."""
        bs = self.block_size
        blocks = list(range(-(-self.length // bs))) if self.whole else sorted({p // bs for p in rnd.loss})
        return blocks, self._size(blocks)

    def add(self, rnd: Round, weight: float) -> None:
        blocks, size = self.copy_of(rnd)
        self.rounds.append(rnd)
        self.weights.append(weight)
        self.copies.append(blocks)
        self.tokens += size


def group_rounds(items: Sequence[tuple[int, Completion, Round]], weights: Sequence[float], rows: str,
                 block_size: int, budget: int) -> list[RoundGroup]:
    """One optimiser step's round rows (k, completion, round) with their weights as groups: with
    rows "response" every response's rounds in one group (in order of first appearance), split
    where a group would pass `budget` tokens; with "round" one group per round, its copy whole."""
    if rows not in UPDATE_ROWS:
        raise ValueError(f"rows must be one of {UPDATE_ROWS}, got {rows!r}")
    open_group: dict[int, RoundGroup] = {}
    out = []
    for (k, c, rnd), w in zip(items, weights):
        group = open_group.get(k) if rows == "response" else None
        if group is None or group.tokens + group.copy_of(rnd)[1] > budget:
            group = open_group[k] = RoundGroup(k, c, block_size, whole=rows == "round")
            out.append(group)
        group.add(rnd, w)
    return out


def group_bound(prompt_len: int, length: int, block_size: int, rows: str) -> int:
    """The most tokens a group of one response's rounds holds however the budget splits them: a
    group starts with the clean stream (prompt, response and tail: `length` tokens) and one noisy
    copy, which holds (rows "response") at most the blocks from the one the prompt ends in to the
    end, or (rows "round") the whole sequence. A budget of at least this many tokens never holds a
    micro-batch over it (`flex_length`)."""
    return length + (length if rows == "round" else length - prompt_len // block_size * block_size)


def largest_group(completions, rows: str, block_size: int) -> int:
    """The largest `group_bound` of `completions` (None or empty ones skipped; none: 0)."""
    return max((group_bound(len(c.prompt_ids), len(c.prompt_ids) + len(c.tokens) + len(c.tail_tokens), block_size,
                            rows) for c in completions if c is not None and c.tokens), default=0)


def micro_batches(groups: list[RoundGroup], budget: int) -> list[list[RoundGroup]]:
    """Groups in micro-batches of at most `budget` tokens each (a group over it alone): first-fit
    decreasing, ties in the given order, so the plan depends on the groups alone."""
    bins: list[list[RoundGroup]] = []
    loads: list[int] = []
    for g in sorted(groups, key=lambda g: -g.tokens):
        j = next((j for j, load in enumerate(loads) if load + g.tokens <= budget), len(bins))
        if j == len(bins):
            bins.append([])
            loads.append(0)
        bins[j].append(g)
        loads[j] += g.tokens
    return bins


@dataclass
class PackedBatch:
    """Update rows: per token its id, position, stream (0 clean, r >= 1 noisy copy r) and sample,
    all [B, L]; per loss token (in `loss_at` order, row-major) its target (the clean token), weight
    and advantage. `tokens` and `visible_pairs` count the real tokens and the (query, key) pairs the
    mask lets attend (`update_flops`); `rounds` names the loss tokens' rounds in that order: (response
    k, round index, loss tokens) each (`dice.rl.update.OldLogprobs`). Padding goes on along the
    position grid as sample -1 in stream 1: no real token sees it, and a padding token sees only its
    own block of padding (every row keeps a visible key; the FlexAttention mask visits one tile per
    tile of padding, not the triangle a clean stream of padding would cost)."""
    ids: torch.Tensor
    position_ids: torch.Tensor
    stream: torch.Tensor
    sample_ids: torch.Tensor
    loss_at: torch.Tensor
    targets: torch.Tensor
    token_weight: torch.Tensor
    advantage: torch.Tensor
    tokens: int = 0
    visible_pairs: int = 0
    rounds: list[tuple[int, int, int]] = field(default_factory=list)


def _layout(group: RoundGroup, mask_id: int) -> tuple[dict, int]:
    """Per-token columns (id, position, stream, loss, target, weight) of [x_t^1 ; ... ; x_t^R ; x_0]
    for one group, and its visible (query, key) pairs: a clean query at p sees the clean blocks up
    to its own, a noisy block b of s tokens its own s and the b * block_size clean tokens before it."""
    c, block_size = group.completion, group.block_size
    seq = torch.tensor(c.prompt_ids + c.tokens + c.tail_tokens, dtype=torch.long)
    n = len(seq)
    clean_pos = torch.arange(n)
    pairs = int(((clean_pos // block_size + 1) * block_size).clamp(max=n).sum())
    parts = []
    for r, (rnd, w, copy) in enumerate(zip(group.rounds, group.weights, group.copies), start=1):
        blocks = torch.tensor(copy, dtype=torch.long)
        pos = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
        pos = pos[pos < n]
        sizes = (blocks * block_size + block_size).clamp(max=n) - blocks * block_size
        pairs += int((sizes * (sizes + blocks * block_size)).sum())
        masked, loss = torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)
        masked[rnd.masked], loss[rnd.loss] = True, True
        parts.append({"ids": seq[pos].masked_fill(masked[pos], mask_id), "pos": pos,
                      "stream": torch.full_like(pos, r), "loss": loss[pos], "target": seq[pos],
                      "weight": torch.full((len(pos),), w)})
    parts.append({"ids": seq, "pos": clean_pos, "stream": torch.zeros_like(seq),
                  "loss": torch.zeros(n, dtype=torch.bool), "target": seq, "weight": torch.zeros(n)})
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}, pairs


def pack(rows: list[list[RoundGroup]], mask_id: int, pad_id: int, advantages: Sequence[float]) -> PackedBatch:
    """A micro-batch whose row i holds the groups rows[i] one after another (sample ids 0, 1, ...),
    padded to the longest row with `pad_id` (`PackedBatch`)."""
    laid, pairs, rounds = [], 0, []
    for groups in rows:
        cols = []
        for s, g in enumerate(groups):
            col, visible = _layout(g, mask_id)
            cols.append({**col, "sample": torch.full_like(col["pos"], s),
                         "advantage": torch.full((len(col["pos"]),), float(advantages[g.k]))})
            pairs += visible
            rounds += [(g.k, rnd.index, len(rnd.loss)) for rnd in g.rounds]
        laid.append({key: torch.cat([col[key] for col in cols]) for key in cols[0]})
    L, B = max(len(row["ids"]) for row in laid), len(rows)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    positions = torch.arange(L).repeat(B, 1)
    stream, sample = torch.ones(B, L, dtype=torch.long), torch.full((B, L), -1, dtype=torch.long)
    loss_at = torch.zeros(B, L, dtype=torch.bool)
    for i, row in enumerate(laid):
        m = len(row["ids"])
        ids[i, :m], positions[i, :m], stream[i, :m] = row["ids"], row["pos"], row["stream"]
        sample[i, :m], loss_at[i, :m] = row["sample"], row["loss"]
    picked = lambda key: torch.cat([row[key][row["loss"]] for row in laid])  # noqa: E731 - loss_at order
    return PackedBatch(ids, positions, stream, sample, loss_at, picked("target"), picked("weight"),
                       picked("advantage"), tokens=sum(len(row["ids"]) for row in laid), visible_pairs=pairs,
                       rounds=rounds)


def empty_batch(block_size: int, pad_id: int) -> PackedBatch:
    """One block of a clean stream without loss tokens: a forward and backward that train nothing
    (under FSDP every rank runs as many micro-batches as the busiest)."""
    ids = torch.full((1, block_size), pad_id, dtype=torch.long)
    zeros = torch.zeros(0)
    return PackedBatch(ids, torch.arange(block_size)[None], torch.zeros_like(ids), torch.zeros_like(ids),
                       torch.zeros_like(ids, dtype=torch.bool), torch.zeros(0, dtype=torch.long), zeros, zeros,
                       tokens=block_size, visible_pairs=block_size * block_size)


def flex_length(tokens: int, budget: int) -> int:
    """The row length of a FlexAttention micro-batch of `tokens` tokens under a budget of `budget`:
    the budget, or the smallest multiple of it that holds a micro-batch over it (one group alone,
    when a response's clean stream and one copy pass the budget). So an update's micro-batches have
    the shape [1, budget], rarely [1, m x budget]: compiled FlexAttention and its block masks
    compile once per shape and process (`dice.model.attention`), in the first update that meets it."""
    return budget * -(-tokens // budget)


def pad_batch(batch: PackedBatch, length: int) -> PackedBatch:
    """`batch` padded to `length` tokens a row (token 0, sample -1, stream 1: `PackedBatch`); its
    loss tokens and their order are unchanged."""
    rows, n = batch.ids.shape

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        out = t.new_full((rows, length), value)
        out[:, :n] = t
        return out

    positions = torch.arange(length).repeat(rows, 1)   # padding goes on along the grid
    positions[:, :n] = batch.position_ids
    return PackedBatch(pad(batch.ids, 0), positions, pad(batch.stream, 1), pad(batch.sample_ids, -1),
                       pad(batch.loss_at, False), batch.targets, batch.token_weight, batch.advantage,
                       batch.tokens, batch.visible_pairs, batch.rounds)


def packed_logprobs(model, batch: PackedBatch, use_flex: bool | None = None) -> torch.Tensor:
    """log p(target | its noisy copy and the clean past) at every loss token, in `loss_at` order: [N].

    use_flex (None: on CUDA) attends through the block-sparse FlexAttention mask, over the batch as
    given: `dice.rl.update.update_plan` pads the update's micro-batches to `flex_length`."""
    device = compute_device(model)
    if use_flex is None:
        use_flex = device.type == "cuda"
    to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    pos, stream, sample = to(batch.position_ids), to(batch.stream), to(batch.sample_ids)
    mask = (flex_streams_mask if use_flex else streams_mask)(pos // model.config.block_size, stream, sample)
    logits = model(to(batch.ids), pos, mask, logits_at=to(batch.loss_at))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # bf16 logits: CE in float32
    return -F.cross_entropy(logits, to(batch.targets), reduction="none")


def update_flops(config, batch: PackedBatch, backward: bool = True) -> float:
    """Model FLOPs of one forward (and backward: 3x) over `batch`: 2 * (layer matmul parameters) per
    real token, 4 * layers * heads * head_dim per visible (query, key) pair, 2 * hidden * vocab per
    loss token (logits are computed there alone). Padding and recomputation are not counted."""
    c = config
    forward = (2 * c.num_parameters(include_embedding=False) * batch.tokens
               + 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * batch.visible_pairs
               + 2 * c.hidden_size * c.vocab_size * int(batch.targets.numel()))
    return 3 * forward if backward else forward


# the (pass, shape) pairs this process has run through compiled FlexAttention (`CompileClock`)
FLEX_MET: set = set()


class CompileClock:
    """The seconds an update spent compiling (`compile_s`). Compiled FlexAttention and its block
    masks (`dice.model.attention`) compile once per process for each shape and pass (a no-grad forward;
    a forward and backward), and an update's micro-batches come in one shape (`dice.rl.update.update_plan`), so a
    process's first update compiles and later ones do not. `run` times each micro-batch to its end
    on the device; one whose (pass, shape) is new to `met` counts its time beyond the median time
    per token of this update's other micro-batches of that pass, or with none to compare its whole
    time (an upper bound). met None (nothing compiles: dense masks, or the CPU) counts nothing."""

    def __init__(self, met: set | None, device: torch.device):
        self.met, self.device, self.times = met, device, []

    @classmethod
    def for_masks(cls, use_flex: bool, device: torch.device) -> "CompileClock":
        """The clock of passes through `packed_logprobs`: FlexAttention on CUDA compiles, else nothing."""
        return cls(FLEX_MET if use_flex and device.type == "cuda" else None, device)

    def run(self, kind: str, batch: PackedBatch, fn):
        """fn(), the pass `kind` over `batch`, timed."""
        if self.met is None:   # nothing compiles: no time to take, no synchronize on the step's path
            return fn()
        key = (kind, tuple(batch.ids.shape))
        new = key not in self.met
        start = time.perf_counter()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append((kind, new, batch.ids.numel(), time.perf_counter() - start))
        self.met.add(key)
        return out

    def seconds(self) -> float:
        """The compile seconds of the micro-batches run so far (class docstring)."""
        extra = 0.0
        for kind, new, n, t in self.times:
            if new:
                steady = [s / m for k, fresh, m, s in self.times if k == kind and not fresh]
                extra += max(0.0, t - statistics.median(steady) * n) if steady else t
        return extra


def uses_flex(cfg, device: torch.device) -> bool:
    """Whether the update's masks are FlexAttention's: `--attention flex`, or auto on CUDA."""
    return {"flex": True, "dense": False}.get(cfg.attention, device.type == "cuda")
