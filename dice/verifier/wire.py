"""Everything that crosses the pipe between the trainer and a worker, and between a candidate
worker and the judge (DESIGN.md §8).

Requests are plain dicts sent by the trusted side. Replies from a worker are decoded by
`plain_loads` (built-in types only: no class or function is ever looked up, so a reply cannot run
code in the trainer) and then checked field by field by `malformed_reply` (the trainer reads no
other field). Candidate outputs reach the judge as bytes that `import_tensor` decodes: a CUDA tensor
through torch's CUDA-IPC rebuild (no copy) or a CPU tensor from its raw bytes, nothing else.
"""
from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 - registers the CUDA IPC reductions on ForkingPickler

from .rules import trusted

STATUSES = ("correct", "incorrect", "compile_error", "runtime_error", "timeout", "invalid")


def export_tensor(t: torch.Tensor, copy: bool = True) -> tuple[bytes, torch.Tensor]:
    """(bytes for `import_tensor` in the judge, tensor to keep alive meanwhile). A CUDA tensor torch
    cannot share is copied first, or, without `copy` (memory the judge must see as it changes),
    raises."""
    t = t.detach()
    if not t.is_cuda:   # the memory the tensor spans, and its strides: the judge sees the layout a caller gets
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
        flat = t.as_strided((span,), (1,), t.storage_offset())
        raw = trusted.clone(flat).view(torch.uint8) if span else torch.empty(0, dtype=torch.uint8)
        return pickle.dumps(("cpu", str(t.dtype), list(t.shape), list(t.stride()), raw.numpy().tobytes())), t
    try:
        return bytes(ForkingPickler.dumps(t)), t
    except Exception:
        if not copy:
            raise
        # Memory from another allocator (e.g. CuPy's pool) cannot be IPC-shared by torch: copy it.
        t = trusted.clone(t)
        return bytes(ForkingPickler.dumps(t)), t


class _StrictUnpickler(pickle.Unpickler):
    """Looks up only the globals in `allowed`: unpickling then cannot call anything else."""

    def __init__(self, data: bytes, allowed: frozenset):
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed here")
        return super().find_class(module, name)


_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_CUDA_TENSOR_GLOBALS = frozenset(
    {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), ("torch", "Tensor"), ("torch", "Size"),
     ("torch", "device"), ("torch.storage", "TypedStorage")} | {("torch", str(d)[6:]) for d in _DTYPES.values()})


def plain_loads(data: bytes):
    """Unpickle built-in data (dict, list, tuple, str, bytes, numbers, bool, None) and nothing else."""
    return _StrictUnpickler(data, frozenset()).load()


def import_tensor(data: bytes) -> torch.Tensor:
    """The judge's side of `export_tensor`: a CUDA tensor through torch's IPC rebuild, or a CPU
    tensor from its raw bytes; anything else raises."""
    value = _StrictUnpickler(data, _CUDA_TENSOR_GLOBALS).load()
    if isinstance(value, tuple) and len(value) == 5 and value[0] == "cpu":
        _, dtype, shape, stride, raw = value
        if (dtype not in _DTYPES or not isinstance(raw, bytes) or len(shape) != len(stride)
                or not all(type(n) is int and n >= 0 for n in (*shape, *stride))):
            raise ValueError("malformed CPU tensor from the candidate worker")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        flat = flat.view(_DTYPES[dtype])
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
        if span > flat.numel():
            raise ValueError("malformed CPU tensor from the candidate worker")
        value = flat.as_strided(shape, stride)
    if type(value) is not torch.Tensor:
        raise ValueError(f"the candidate worker sent a {type(value).__name__}, not a tensor")
    return value


def malformed_reply(op: str, reply: dict) -> str | None:
    """Why a candidate worker's reply does not fit its op's schema, or None. The parent reads
    nothing else from a reply, so a tampered worker can lie within these types (a false claim the
    trusted side checks) but cannot crash the caller.

    Replies with status "ok": run -> outputs, second (list of bytes or None), inputs ([int, bytes]:
    the inputs forward modified), records (raw CUPTI records, `kernels.gpu_records`, or None on a
    CPU), own, mutated, stale and reused (ints), aliased and shared ([int, int] pairs); time_prepare -> method,
    records, own, outputs (a graph's outputs as bytes, else None); `own` None or a list of names.
    time_call replies with its status alone: the parent's clock times it."""
    status, message = reply.get("status"), reply.get("message", "")
    if status not in (*STATUSES, "ok") or not isinstance(message, str):
        return f"has status {str(status)[:40]!r}"
    if status != "ok" or op in ("load", "unload"):
        return None
    fields = {
        "run": lambda r: (_byte_list(r.get("outputs")) and (r.get("second") is None or _byte_list(r["second"]))
                          and isinstance(r.get("inputs"), list)
                          and all(isinstance(p, list) and len(p) == 2 and type(p[0]) is int and isinstance(p[1], bytes)
                                  for p in r["inputs"])
                          and _records(r.get("records")) and _names(r.get("own")) and _ints(r.get("mutated"))
                          and _ints(r.get("stale")) and _pairs(r.get("aliased")) and _ints(r.get("reused"))
                          and _pairs(r.get("shared"))),
        "time_prepare": lambda r: (r.get("method") in ("graph", "eager") and _records(r.get("records"))
                                   and _names(r.get("own"))
                                   and (r.get("outputs") is None or _byte_list(r["outputs"]))),
    }
    if op in fields and not fields[op](reply):
        return "has fields of the wrong types"
    return None


def _pairs(x) -> bool:
    return isinstance(x, list) and all(_ints(p, 2) for p in x)


def _ints(x, n=None) -> bool:
    return isinstance(x, list) and all(type(i) is int for i in x) and (n is None or len(x) == n)


def _byte_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(o, bytes) for o in x)


def _names(x) -> bool:
    return x is None or isinstance(x, list) and all(isinstance(n, str) for n in x)


def _records(x) -> bool:
    """None (CPU) or raw CUPTI records: [name, start_ns, end_ns, correlation_id, on_gpu] with
    start <= end."""
    return x is None or (isinstance(x, list) and all(
        isinstance(r, list) and len(r) == 5 and isinstance(r[0], str) and type(r[1]) is int and type(r[2]) is int
        and r[1] <= r[2] and type(r[3]) is int and type(r[4]) is bool for r in x))
