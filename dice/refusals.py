"""Refusals before a command starts for lack of memory, and the one-line error when it runs out all the
same (DESIGN.md §5, §7): the sizes come from `dice.memory`'s estimates, the free memory from
`memory.free_bytes` (looked up at each call, so a test can set it)."""
from __future__ import annotations

import math

import torch

from . import memory
from .errors import UserError
from .memory import (FLEX_TILE, GIB, LOSS_SHARE, UPDATE_SHARE, MemoryShortage, parameter_bytes, update_fixed_bytes,
                     update_token_bytes)


def check_update_fits(config, device: torch.device, *, tokens: int, longest: int, gradient_checkpointing: bool,
                      autocast: bool, processes: int, others: int, flags: dict[str, str], offload: bool = False) -> None:
    """Refuse, before any rollout, an RL update that cannot run on `device` (free now, before the
    model loads): float32 weights, gradients and AdamW moments (16 bytes a parameter; FSDP2 shards
    them over `processes`) and `update_fixed_bytes`, beside `others` bytes of the verifier's
    processes, and one micro-batch. Auto (`tokens` 0): the micro-batch of the largest group, `longest`
    tokens, planned as `plan_update_tokens` will plan it (within UPDATE_SHARE, at the upper bound
    `update_token_bytes`). An explicit `--update-tokens` is the user's: refused where its
    micro-batch's activations alone, without the logits, pass all the free memory, or where the
    state leaves the plan no room for any micro-batch (which refuses every budget). The fix named:
    flags["state"] (the command's words for a smaller model or more GPUs; with fewer of
    flags["workers"] where that would make the room), or the first of auto flags["tokens"],
    flags["checkpointing"], a lower flags["length"] that would fit. offload (`--offload cpu`): the
    float32 weights, gradients and moments are in host memory, none of them on `device`."""
    free = memory.free_bytes(device)
    weights, state = (0, 0) if offload else (parameter_bytes(config, 4, processes), parameter_bytes(config, 12, processes))
    fixed = state + update_fixed_bytes(config, autocast, processes)
    granule = math.lcm(config.block_size, FLEX_TILE)
    least = max(granule, -(-longest // granule) * granule)
    explicit = bool(tokens)
    # an explicit budget's micro-batches: the budget, or a multiple of it for a group over it (`flex_length`)
    micro = (tokens * -(-longest // tokens) if longest > tokens else tokens) if explicit else least

    def fits(ckpt: bool, size: int, verifier: int = others, planned: bool = not explicit) -> tuple[bool, int]:
        """(whether a micro-batch of `size` tokens fits, its bytes), planned or (explicit) at least."""
        per_token = update_token_bytes(config, ckpt, 2 if autocast else 4, LOSS_SHARE if planned else 0)
        left = free - weights - verifier
        return (UPDATE_SHARE * left if planned else left) - fixed >= size * per_token, size * per_token

    # auto may turn gradient checkpointing on (`UpdateTokens.plan`): refused only where even that cannot fit
    ok, need = fits(gradient_checkpointing or not explicit, micro)
    # the state leaves the plan no room: refused whatever the budget (the 4B on an 80 GB GPU)
    starved = not fits(True, granule, planned=True)[0]
    if ok and not starved:
        return
    if starved:
        fix = flags["state"] + (f", or fewer {flags['workers']}"
                                if others and fits(True, granule, 0, planned=True)[0] else "")
    elif explicit and fits(gradient_checkpointing, least, planned=True)[0]:
        fix = f"pass {flags['tokens']} auto (planned to fit) or a smaller one"
    elif not gradient_checkpointing and fits(True, micro)[0]:
        fix = f"pass {flags['checkpointing']}"
    else:
        fix = f"lower {flags['length']}" + ("" if gradient_checkpointing else f" and pass {flags['checkpointing']}")
    parts = {"float32 weights, gradients and AdamW moments": weights + state,
             "bf16 weight copies and a gradient's casts": fixed - state, "the verifier's processes": others,
             (f"a micro-batch's activations ({micro} tokens)" if explicit else f"a micro-batch of {micro} tokens"): need}
    shown = ", ".join(f"{what} {_gib(size)}" for what, size in parts.items() if size)
    within = "" if explicit else f", planned within {UPDATE_SHARE:.0%} of what the weights and the verifier leave"
    raise MemoryShortage(f"the RL update needs {_gib(sum(parts.values()))} on {device} ({shown}) and "
                         f"{_gib(free)} is free{within}; {fix}")


def check_fits(parts: dict[str, int], device: torch.device, fix: str) -> None:
    """Refuse when the parts (what -> bytes) need more than `device` has free, naming them and `fix`."""
    need, free = sum(parts.values()), memory.free_bytes(device)
    if need > free:
        shown = ", ".join(f"{what} {_gib(size)}" for what, size in parts.items())
        raise MemoryShortage(f"these sizes need at least {_gib(need)} on {device} ({shown}) and {_gib(free)} "
                             f"is free; {fix}")


def out_of_memory(what: str, device: torch.device, sizes: str, fix: str) -> UserError:
    """The one-line error for `what` that ran out of GPU memory at `sizes`: how much was in use on
    `device` (other processes, the verifier's, included) and the flag that fixes it."""
    free, total = torch.cuda.mem_get_info(device) if device.type == "cuda" else (0, 0)
    return UserError(f"{what} ran out of GPU memory ({(total - free) / GIB:.0f} of {total / GIB:.0f} GiB in use, "
                     f"other processes' (the verifier's) included) with {sizes}; pass {fix}")


def _gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB" if size >= GIB / 10 else f"{size / GIB:.3f} GiB"
