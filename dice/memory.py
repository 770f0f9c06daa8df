"""Memory a command will need, estimated up front on the device in use, against what is free there.

The estimates are lower bounds, the allocations the command makes for certain, so a refusal never
stops a run that would fit (one that passes can still run out later, in memory not counted here):
- parameters: 4 bytes each in float32, 2 in bf16; training adds the gradient and AdamW's two
  moments, 16 bytes a float32 parameter (FSDP2 splits them over the processes);
- generation: the KV cache the sampler allocates for the whole length up front (DESIGN.md §5),
  batch x length x layers x 2 (keys, values) x kv_heads x head_dim, in the generation dtype, and
  its rows (token ids, positions and step map as int64, two masks: 26 bytes a position);
- a training micro-batch: its float32 logits, rows x row length x vocab x 4 bytes (SFT rows are
  doubled, `[x_t ; x_0]`, DESIGN.md §4), and on a CPU the dense attention bias, rows x length^2 x 4.
Free memory: CUDA's free device memory; on a CPU MemAvailable, or less where a cgroup limit says so.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .errors import UserError

GIB = 2 ** 30
ROW_STATE_BYTES = 3 * 8 + 2   # the sampler's x, pos, step_map (int64) and valid, generated (bool) per position


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


def check_fits(parts: dict[str, int], device: torch.device, fix: str) -> None:
    """Refuse when the parts (what -> bytes) need more than `device` has free, naming them and `fix`."""
    need, free = sum(parts.values()), free_bytes(device)
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
