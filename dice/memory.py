"""Memory a command will need, estimated up front on the device in use, against what is free there;
and the two sizes BiC-RL plans from the GPU memory free: the rollout batch and the update's
micro-batch budget (DESIGN.md §5, §7).

The estimates are lower bounds, the allocations the command makes for certain, so a refusal never
stops a run that would fit (one that passes can still run out later, in memory not counted here):
- parameters: 4 bytes each in float32, 2 in bf16; training adds the gradient and AdamW's two
  moments, 16 bytes a float32 parameter (FSDP2 splits them over the processes);
- generation: the KV cache the sampler allocates for the whole length up front (DESIGN.md §5),
  batch x length x layers x 2 (keys, values) x kv_heads x head_dim, in the generation dtype, and
  its rows (token ids, positions and step map as int64, two masks: 26 bytes a position);
- a training micro-batch: its float32 logits, rows x row length x vocab x 4 bytes (SFT rows are
  doubled, `[x_t ; x_0]`, DESIGN.md §4), and on a CPU the dense attention bias, rows x length^2 x 4;
- the RL update: its micro-batch budget is planned, not only checked (`update_token_bytes` a token,
  `update_fixed_bytes` beside the optimiser's state, `plan_update_tokens`); these count what a
  micro-batch holds at its peak, an upper bound. `dice.refusals.check_update_fits` refuses, before the first
  rollout, the sizes whose training state leaves the plan no room, or whose plan could not hold the
  micro-batch of one response of --max-new-tokens, which any step may bring.
Free memory: CUDA's free device memory; on a CPU MemAvailable, or less where a cgroup limit says so.

Both planned sizes leave room for the verifier's processes (`planned_verifier_bytes` before they
start, `Verifier.gpu_bytes` once they run). The rollout batch (`auto_rollout_batch`, bench rl's auto
batch): as many sequences of `rollout_sequence_bytes` as ROLLOUT_SHARE of what this process can take
holds. The update's budget (`UpdateTokens`): `--update-tokens` 0 (auto, the default) asks at the
start of every update, and of the old log-probs' pass beside the reward's tail that shares its
micro-batches' shape (`dice.rl.update.OldLogprobs`), what this process can take on the GPU
(`gpu_memory`: by then the rollouts' KV caches are freed into its allocator, and the float32 weights
and the old log-probs are allocated). The plan (`plan_update_tokens`) sets aside what the update
will allocate and has not yet: every parameter's gradient where it is None (4 bytes a float32
parameter: each optimiser step sets them to None), AdamW's two moments where the optimiser holds no
state for it (8 bytes: `--optimizer-state step` drops them after every update,
`dice.rl.update.restart_moments`, and the first optimiser step makes them again), the bf16 weight
copies and a gradient's casts (`update_fixed_bytes`), and what the verifier's processes do not hold
yet; the rest, `update_token_bytes` a token, is the budget. The plan counts FlexAttention's masks
(CUDA's default); `--attention dense` on a GPU adds [rows, L, L] masks it does not count. On a CPU
there is no device memory to plan: UPDATE_TOKENS_CPU.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable, Sequence

import torch

from .errors import UserError
from .model.packing import group_bound, largest_group
from .model.sdar import compute_device
from .runtime import rank_verifier
from .sampling.sampler import CachedForward

GIB = 2 ** 30
ROW_STATE_BYTES = 3 * 8 + 2   # the sampler's x, pos, step_map (int64) and valid, generated (bool) per position
# of the free GPU memory that `auto_rollout_batch` plans the sampler into at most; the rest is for
# the allocator's fragments and the judges' reference outputs (cached up to 4 GiB each), beside
# the memory set aside for the verifier's processes themselves
ROLLOUT_SHARE = 0.8
# of what this process can take (beside the verifier's processes) that the update's plan fills at most;
# the rest is for the allocator's fragments, in which the rollouts' freed KV caches are cut up
UPDATE_SHARE = 0.9
# the most an automatic budget plans: the fixed default it replaces; a larger one pads each optimiser
# step's last micro-batch more (FlexAttention's micro-batches are all [1, budget])
UPDATE_TOKENS_MAX = 16384
UPDATE_TOKENS_CPU = 16384     # `--update-tokens` auto on a CPU, where there is no device memory to plan
# an update micro-batch's loss tokens are at most half its tokens: each sits in one noisy copy and
# once more in its response's clean stream (`dice.model.packing`)
LOSS_SHARE = 0.5
FLEX_TILE = 128               # FlexAttention's block: an automatic budget is a whole number of them
CHECKPOINTING = "turn on gradient checkpointing (train.py --gradient-checkpointing, bench rl --grad-ckpt)"


class MemoryShortage(UserError):
    """Sizes whose lower-bound memory exceeds what the device has free."""


def free_bytes(device: torch.device) -> int:
    """Bytes free for this process on `device`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = math.inf
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        if "MemAvailable" in fields:
            free = int(fields["MemAvailable"].split()[0]) * 1024
    limit, used = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    if limit.is_file() and used.is_file() and limit.read_text().strip().isdigit():
        free = min(free, int(limit.read_text()) - int(used.read_text()))
    return int(free) if math.isfinite(free) else 2 ** 62


def gpu_memory(device: torch.device) -> tuple[int, int]:
    """(bytes this process can still take on `device`: free plus its allocator's unused cache,
    bytes in use outside its allocator: other processes, and its own CUDA context)."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return free + reserved - torch.cuda.memory_allocated(device), total - free - reserved


def kv_cache_bytes(config, batch: int, length: int, dtype_bytes: int) -> int:
    """The sampler's KV cache and rows for `batch` sequences of `length` positions (block-rounded)."""
    positions = batch * -(-length // config.block_size) * config.block_size
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes
    return positions * (kv + ROW_STATE_BYTES)


def parameter_bytes(config, bytes_per_parameter: int, processes: int = 1) -> int:
    return config.num_parameters() * bytes_per_parameter // processes


def micro_batch_bytes(config, rows: int, length: int, dense_attention: bool) -> int:
    """A training micro-batch's float32 logits, and the dense attention bias on a CPU."""
    return rows * length * config.vocab_size * 4 + (rows * length * length * 4 if dense_attention else 0)


def planned_verifier_bytes(workers: int, device: torch.device) -> int:
    """The GPU memory this process's Verifier (`dice.runtime.rank_verifier`'s share of `workers`) will
    hold once it has verified a while (`Verifier.gpu_bytes`: its workers, judges and baseline), known
    before it starts: the memory checks of train.py and bench rl set it aside."""
    from .verifier.pool_costs import pool_gpu_bytes   # lazy: importing this module skips dice.verifier's imports
    return pool_gpu_bytes(rank_verifier(workers, device)["workers"])


# ---------------------------------------------------------------- the rollout batch

def rollout_sequence_bytes(config, prompt_len: int, max_new_tokens: int, element_size: int) -> int:
    """GPU memory one rollout sequence takes in the sampler: every layer's keys and values and the
    sampler's row state (`kv_cache_bytes`) for its prompt + max_new_tokens (the sampler allocates
    the whole length up front, DESIGN.md §5); its share of a step's logits work: float32 copies of
    a block's [block, vocab] logits in the token choice, and a logits buffer in each CUDA graph the
    sampler captures (one per KV_BUCKET of cache length); and, while a batch's prompts are
    prefilled in one forward, a layer's activations for its prompt: the MLP's gate, up, their SiLU
    and product (4 x intermediate) and ~6 hidden-sized vectors a token."""
    c, bs = config, config.block_size
    length = (prompt_len // bs + 1 + -(-max_new_tokens // bs)) * bs
    kv = kv_cache_bytes(c, 1, length, element_size)
    logits = bs * c.vocab_size
    scratch = 8 * logits * 4 + (length // CachedForward.KV_BUCKET + 1) * logits * element_size
    prefill = prompt_len * (4 * c.intermediate_size + 6 * c.hidden_size) * element_size
    return kv + scratch + prefill


def auto_rollout_batch(model, prompt_lens: Sequence[int], max_new_tokens: int, others_bytes: int = 0) -> int:
    """The largest rollout batch whose sampler state (`rollout_sequence_bytes` a sequence) fits
    in ROLLOUT_SHARE of what this process can take on the GPU, and leaves room for what the
    verifier's processes (others_bytes: `dice.verifier.Verifier.gpu_bytes`) do not hold yet: they
    grow from ~0.2 GiB each at start-up to ~1 GiB once they have verified (17 GiB beside a
    14-worker reward). On a CPU: every prompt in one batch."""
    first = next(model.parameters())
    if first.device.type != "cuda":
        return len(prompt_lens)
    per_sequence = rollout_sequence_bytes(model.config, max(prompt_lens), max_new_tokens, first.element_size())
    available, in_use = gpu_memory(first.device)
    budget = min(ROLLOUT_SHARE * available, available - max(0, others_bytes - in_use))
    return max(1, min(len(prompt_lens), int(budget // per_sequence)))


# ---------------------------------------------------------------- the RL update's micro-batch budget

def update_token_bytes(config, gradient_checkpointing: bool, element_size: int = 2,
                       loss_share: float = LOSS_SHARE) -> int:
    """Bytes one token of an RL update micro-batch holds at the backward's peak (`dice.model.packing`:
    a FlexAttention forward and backward with float32 master weights; element_size 2 under bf16
    autocast, 4 in float32). With h hidden, q = heads x head_dim, k = kv_heads x head_dim, I the MLP
    width, H heads, K kv_heads, a = element_size, each layer keeps for the backward:
      2 (8 + a) h   each sublayer's float32 residual input and RMSNorm output, and its Linear's input
                    cast to a bytes (the residual stream stays float32: the embedding's output is);
      8 (q + k)     q's and k's RMSNorm and RoPE: under autocast the norm's float32 input (4), its
                    output cast back (2) and RoPE's float32 output cast for attention (2); in
                    float32 the norm's output (4) and RoPE's (4);
      a (q + 2k)    the fused qkv product, held whole by v, a view of it;
      2 a q         attention's output and o_proj's input (the transposed copy);
      4 a I         gate_up's product (2I, held by SiLU's input, a view of it), SiLU's and the product;
      4 (2H + K + 2)  attention's log-sum-exp and the four norms' 1/rms, float32 per row.
    Without gradient checkpointing all L layers keep theirs; with it each layer keeps only its float32
    input (4h) and the backward recomputes one layer at a time. Besides: RoPE's float32 cos and sin
    (8 x head_dim), the final norm's input and output (8h). The logits are computed at the loss
    tokens alone, at most `loss_share` of the tokens (LOSS_SHARE); each holds at the backward's
    start its float32 log-softmax (kept by the loss), the loss's gradient and the log-softmax's
    gradient over the vocabulary V, 12 V bytes, and its hidden state gathered and cast, 6h. The
    backward frees those before it reaches the layers, whose gradients come after: one layer's
    again (with checkpointing: the recomputed layer and its gradients, 2 layers), so a token holds
    the larger of the two:
      L x layer + max(layer, logits)          without checkpointing,
      L x 4h + max(2 x layer, logits)         with it (its forward ends holding 8 V of the 12),
    logits = loss_share x (12 V + 6h). Against the peaks measured on an H100 (1.7B shape, micro-batches
    of 2,048 to 8,192 tokens, tests/test_update_memory.py), with `update_fixed_bytes`: 1.07-1.17 x
    without checkpointing, 1.39-1.48 x with it."""
    c = config
    h, L, V, I = c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size
    q, k = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    a = element_size
    layer = (2 * (8 + a) * h + 8 * (q + k) + a * (q + 2 * k) + 2 * a * q + 4 * a * I
             + 4 * (2 * c.num_attention_heads + c.num_key_value_heads + 2))
    logits = loss_share * (12 * V + 6 * h)
    kept = L * 4 * h + max(2 * layer, logits) if gradient_checkpointing else L * layer + max(layer, logits)
    return int(kept + 8 * c.head_dim + 8 * h)


def update_fixed_bytes(config, autocast: bool, processes: int = 1) -> int:
    """What an update micro-batch holds besides its tokens and the optimiser's state: under bf16
    autocast the bf16 copies of every matmul weight (autocast casts each float32 weight once and the
    backward keeps the casts: 2 bytes a parameter, on every process); while a gradient accumulates,
    the largest matrix's gradient in bf16 and cast to float32 (6 bytes each of its parameters); and
    under FSDP2 two decoder layers' float32 parameters gathered (one running, the next arriving)."""
    c = config
    h = c.hidden_size
    matmuls = c.num_parameters(include_embedding=False) + c.vocab_size * h
    q, k = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    largest = max(c.vocab_size * h, 2 * c.intermediate_size * h, (q + 2 * k) * h)
    gathered = 2 * 4 * c.num_parameters(include_embedding=False) // c.num_hidden_layers if processes > 1 else 0
    return (2 * matmuls if autocast else 0) + 6 * largest + gathered


def plan_update_tokens(available: int, unheld: int, fixed: int, per_token: int, longest: int, granule: int) -> int:
    """The update's micro-batch budget in tokens, or 0 where the plan cannot hold `longest` tokens:
    of min(UPDATE_SHARE x available, available - unheld) (what this process can take, less what
    other processes, the verifier's, do not hold yet), `fixed` bytes set aside and `per_token` bytes
    a token, rounded down to `granule` and at most UPDATE_TOKENS_MAX, but never below `longest` (the
    largest group of rounds the step packs, rounded up to `granule`), so that no micro-batch passes
    the budget (`dice.model.packing.flex_length`) and FlexAttention meets one shape."""
    room = min(UPDATE_SHARE * available, available - unheld) - fixed
    fits = int(max(room, 0) // per_token)
    least = max(granule, -(-longest // granule) * granule)
    if fits < least:
        return 0
    return max(least, min(fits, UPDATE_TOKENS_MAX) // granule * granule)


def unallocated_state_bytes(model, optimizer) -> int:
    """The GPU bytes of the gradients and AdamW moments the update will allocate and has not: a
    parameter's own size (this process's shard under FSDP2) for a gradient that is None, twice it
    for moments the optimiser does not hold (optimizer None: none held); none for a parameter in
    host memory (`--offload cpu`: its gradient and moments are made there)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p   # an FSDP2 DTensor: this process's shard
        if not p.requires_grad or local.device.type != "cuda":
            continue
        size = local.numel() * local.element_size()
        total += size * ((p.grad is None) + 2 * (optimizer is None or not optimizer.state.get(p)))
    return total


def auto_update_tokens(model, cfg, others_bytes: int = 0, optimizer=None, longest: int = 0, processes: int = 1) -> int:
    """The largest update micro-batch budget (tokens) that fits on the GPU now (module docstring,
    `plan_update_tokens`): a whole number of FlexAttention tiles (and of blocks), at most
    UPDATE_TOKENS_MAX and never below `longest`, the largest group of rounds the step packs
    (`dice.model.packing.largest_group`). others_bytes: what the verifier's processes hold once they
    have verified a while (`Verifier.gpu_bytes`); the part not in use yet is set aside. Where not
    even that group fits, a MemoryShortage naming gradient checkpointing and --max-new-tokens.
    On a CPU: UPDATE_TOKENS_CPU."""
    first, device = next(model.parameters()), compute_device(model)
    if device.type != "cuda":
        return UPDATE_TOKENS_CPU
    config = model.config
    autocast = cfg.dtype in ("auto", "bf16")   # `Runtime.autocast` on CUDA
    per_token = update_token_bytes(config, cfg.gradient_checkpointing, 2 if autocast else first.element_size())
    # autocast copies float32 weights (the RL master weights); weights already bf16 are used as they are
    fixed = update_fixed_bytes(config, autocast and first.dtype == torch.float32, processes)
    fixed += unallocated_state_bytes(model, optimizer)
    available, in_use = gpu_memory(device)
    unheld = max(0, others_bytes - in_use)
    granule = math.lcm(config.block_size, FLEX_TILE)
    tokens = plan_update_tokens(available, unheld, fixed, per_token, longest, granule)
    if tokens:
        return tokens
    fix = "lower --max-new-tokens" + ("" if cfg.gradient_checkpointing else f" or {CHECKPOINTING}")
    raise MemoryShortage(f"the RL update cannot hold a micro-batch of its longest response ({longest} tokens: the "
                         f"clean stream and one noisy copy, {longest * per_token / GIB:.1f} GiB) in the "
                         f"{available / GIB:.1f} GiB this process can take on {device} (other processes, the "
                         f"verifier's, and its CUDA context hold {in_use / GIB:.1f} GiB), less "
                         f"{fixed / GIB:.1f} GiB of gradients, AdamW moments and bf16 weight copies still to come"
                         + (f" and {unheld / GIB:.1f} GiB the verifier's processes do not hold yet" if unheld else "")
                         + f"; {fix}")


class UpdateTokens:
    """An RL run's update micro-batch budget, asked with the step's config at the start of every update
    (`dice.rl.update.policy_update`; the old log-probs' pass, which shares the micro-batches' shape: `for_forwards`):
    `--update-tokens` as given, or auto (`auto_update_tokens`, for the largest group of the step's
    completions), keeping the last budget while it still fits and holds that group, so that compiled
    FlexAttention meets one shape a run and compiles again only where the memory shrank. Under
    torchrun every process calls it alike and all take the smallest. Where the longest group fits only
    with gradient checkpointing, auto turns it on for the rest of the run (`checkpointing`) and says so
    through `log`. others(): the bytes of the verifier's processes (`Verifier.gpu_bytes`); optimizer
    None: no moments held."""

    def __init__(self, model, optimizer, rt, others: Callable[[], int] | None = None,
                 log: Callable[[str], None] | None = None):
        self.model, self.optimizer, self.rt, self.others, self.log = model, optimizer, rt, others, log
        self.last, self.checkpointing = 0, False

    def __call__(self, cfg, completions) -> int:
        """The budget for an update over `completions` (their largest group, `largest_group`)."""
        return self.plan(cfg, largest_group(completions, cfg.update_rows, self.model.config.block_size))

    def for_forwards(self, cfg, completions) -> int:
        """The budget of no-grad forwards over `completions` (the old log-probs, beside the reward's
        tail, the rollouts' bf16 weights still held): the last one planned while it holds their
        largest group, so that they meet the update's shape; such a micro-batch keeps no activations
        and the plan set aside gradients and moments not made yet, so it fits where the update's
        does. None planned yet, or a larger group: a plan now."""
        if cfg.update_tokens:
            return cfg.update_tokens
        if self.last >= largest_group(completions, cfg.update_rows, self.model.config.block_size):
            return self.last
        return self(cfg, completions)

    def before_rollouts(self, cfg, prompt_len: int = 0, response_len: int = 0) -> int:
        """The budget for the longest response a step can bring (`response_len`, or --max-new-tokens,
        after a prompt of `prompt_len`), planned before the first rollout: what no step could hold is
        refused then, not after minutes of rollouts."""
        bs = self.model.config.block_size
        length = -(-(prompt_len + (response_len or cfg.max_new_tokens)) // bs) * bs
        return self.plan(cfg, group_bound(prompt_len, length, bs, cfg.update_rows))

    def plan(self, cfg, longest: int) -> int:
        """The budget for groups of up to `longest` tokens."""
        if cfg.update_tokens:
            return cfg.update_tokens
        tokens, shortage = self._fit(cfg, longest)
        if not tokens and not (cfg.gradient_checkpointing or self.checkpointing):
            self.checkpointing = True
            tokens, again = self._fit(cfg, longest)
            if not tokens:
                self.checkpointing, shortage = False, again or shortage
            else:
                self.model.gradient_checkpointing = True
                if self.log is not None:
                    self.log(f"gradient checkpointing turned on: the update's longest group ({longest} tokens) "
                             f"does not fit this GPU without it ({shortage})")
        if not tokens:
            raise shortage or MemoryShortage("the RL update does not fit another process's GPU (its line above)")
        self.last = self.last if longest <= self.last <= tokens else tokens
        return self.last

    def _fit(self, cfg, longest: int) -> tuple[int, MemoryShortage | None]:
        """(`auto_update_tokens`' budget, the smallest over the processes (0: none fits), this process's
        shortage or None), with gradient checkpointing where `checkpointing` turned it on."""
        cfg = dataclasses.replace(cfg, gradient_checkpointing=cfg.gradient_checkpointing or self.checkpointing)
        # asked on a GPU alone: a reward's stand-in on the CPU (tests) need not know the verifier's memory
        cuda = compute_device(self.model).type == "cuda"
        shortage, tokens = None, 0
        try:
            tokens = auto_update_tokens(self.model, cfg, self.others() if self.others and cuda else 0,
                                        self.optimizer, longest, self.rt.world)
        except MemoryShortage as e:   # said once every process has heard: a process alone must not stop
            shortage = e
        return int(-self.rt.all_max(-tokens)), shortage
