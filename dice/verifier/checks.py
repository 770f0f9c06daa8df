"""What a candidate must satisfy, as plain functions (DESIGN.md §8).

Source rules (run in the parent, on text): the `__global__` kernels a candidate defines, whether a
launched kernel is one of them, and try/except fallbacks to PyTorch. Tensor rules (run in the
workers): exact equality, inputs modified, outputs sharing memory with inputs, fingerprints for
spotting cached outputs, and the allclose comparison with its mismatch report.

`trusted` holds the torch/time functions the verifier relies on, captured when this module is
imported, which a worker does before it runs any candidate code; `replaced_functions()` names the
ones a candidate has since replaced (the worker then reports `invalid` and is recycled).
"""

from __future__ import annotations

import ast
import importlib
import re
import time
import types
from typing import Iterable

import torch
import torch._dynamo  # noqa: F401  importing dynamo wraps torch.manual_seed: capture after it

WATCHED = (
    "torch.allclose", "torch.isclose", "torch.equal", "torch.manual_seed", "torch.no_grad",
    "torch.cuda.synchronize", "torch.cuda.current_stream", "torch.cuda.Event",
    "torch.cuda.Event.record", "torch.cuda.Event.elapsed_time", "torch.Tensor.clone",
    "torch.Tensor.data_ptr", "torch.Tensor.untyped_storage", "torch.nn.Module.__call__",
    "torch.profiler.profile", "time.perf_counter",
)
TORCH_NAMESPACES = ("at", "c10", "cub", "thrust", "cutlass")

trusted = types.SimpleNamespace(
    clone=torch.Tensor.clone,
    equal=torch.equal,
    manual_seed=torch.manual_seed,
    no_grad=torch.no_grad,
    perf_counter=time.perf_counter,
    cuda_synchronize=torch.cuda.synchronize,
    Event=torch.cuda.Event,
    event_record=torch.cuda.Event.record,
    event_elapsed_time=torch.cuda.Event.elapsed_time,
    untyped_storage=torch.Tensor.untyped_storage,
    profile=torch.profiler.profile,
)


def _resolve(dotted: str):
    obj = importlib.import_module(dotted.split(".")[0])
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


_ORIGINALS = {name: _resolve(name) for name in WATCHED}


def replaced_functions() -> list[str]:
    """Names in WATCHED that no longer resolve to the object captured at import."""
    replaced = []
    for name, original in _ORIGINALS.items():
        try:
            if _resolve(name) is not original:
                replaced.append(name)
        except AttributeError:
            replaced.append(name)
    return replaced


# ---------------------------------------------------------------------------------------------
# Source rules.

def kernel_names(source: str) -> list[str]:
    """Names of the `__global__` functions in the CUDA code embedded in `source`."""
    text = re.sub(r"__launch_bounds__\s*\([^)]*\)", " ", source)
    return sorted(set(re.findall(r"__global__\b[^;{}()]*?\b([A-Za-z_]\w*)\s*\(", text)))


def matching_kernels(launched: Iterable[str], defined: Iterable[str]) -> list[str]:
    """The launched kernel names (demangled, as the profiler reports them) that are `defined` ones.

    "void add_kernel<float>(float const*, ...)", "add_kernel" (extern "C") and the mangled
    "_Z10add_kernelPKf..." all match add_kernel; PyTorch's own kernels (at::, cub::...) never do."""
    defined = set(defined)
    hits = []
    for name in launched:
        plain = name.replace("(anonymous namespace)::", "")
        words = re.split(r"[<(]", plain, maxsplit=1)[0].split()
        qualified = words[-1] if words else ""
        namespace, _, base = qualified.rpartition("::")
        mangled = re.match(r"_Z(\d+)", plain)
        if mangled and plain[len(mangled.group(0)):][:int(mangled.group(1))] in defined:
            hits.append(name)
        elif base in defined and namespace.split("::")[0] not in TORCH_NAMESPACES:
            hits.append(name)
    return hits


def fallback_problem(tree: ast.Module) -> str | None:
    """Why a `try` in the candidate falls back to PyTorch when its kernel fails, or None.

    Flagged: an except branch that does not end in `raise` and calls a name imported from torch
    (torch.relu, F.gelu, nn.Linear), the reference `Model`, `super()`, or a `self.x` submodule
    created from torch (self.conv = nn.Conv2d(...))."""
    torch_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names.update(a.asname or "torch" for a in node.names if a.name.split(".")[0] == "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            torch_names.update(a.asname or a.name for a in node.names)

    def root(expr):
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr

    def from_torch(call):
        r = root(call.func)
        return isinstance(r, ast.Name) and r.id in torch_names

    torch_modules = {t.attr for node in ast.walk(tree) if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Call) and from_torch(node.value)
                     for t in node.targets if isinstance(t, ast.Attribute)
                     and isinstance(t.value, ast.Name) and t.value.id == "self"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        for handler in node.handlers:
            if handler.body and isinstance(handler.body[-1], ast.Raise):
                continue
            for call in (n for stmt in handler.body for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                r = root(call.func)
                self_module = (isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
                               and call.func.value.id == "self" and call.func.attr in torch_modules)
                if (from_torch(call) or self_module or (isinstance(r, ast.Name) and r.id == "Model")
                        or (isinstance(r, ast.Call) and isinstance(r.func, ast.Name) and r.func.id == "super")):
                    return (f"line {handler.lineno}: the except branch calls {ast.unparse(call.func)}; a try/except "
                            "that falls back to PyTorch when the custom kernel fails is not allowed")
    return None


# ---------------------------------------------------------------------------------------------
# Tensor rules.

def flatten(output) -> list:
    """Leaves of a (nested) tuple/list output; a single tensor is a one-leaf output."""
    if isinstance(output, (tuple, list)):
        return [leaf for item in output for leaf in flatten(item)]
    return [output]


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of `t` with the same bytes, so equality is exact (NaN == NaN, -0 != 0)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and trusted.equal(as_bits(a), as_bits(b))


def modified_inputs(originals: list, inputs: list) -> list[int]:
    return [j for j, (o, x) in enumerate(zip(originals, inputs)) if o is not None and not same_bits(o, x)]


def aliased_outputs(outputs: list, inputs: list) -> list[list[int]]:
    """[output index, input index] pairs whose storages overlap in memory."""
    def span(t):
        s = trusted.untyped_storage(t)
        return t.device, s.data_ptr(), s.data_ptr() + s.nbytes()
    pairs = []
    for i, out in enumerate(outputs):
        for j, x in enumerate(inputs):
            if isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and out.numel() and x.numel():
                (d1, a1, b1), (d2, a2, b2) = span(out), span(x)
                if d1 == d2 and a1 < b2 and a2 < b1:
                    pairs.append([i, j])
    return pairs


def fingerprint(t: torch.Tensor) -> list:
    """Cheap exact summary: bit-pattern sum and 16 sampled bit patterns. Equal tensors give equal
    fingerprints; tensors computed from different random inputs practically never do."""
    bits = as_bits(t.detach()).reshape(-1)
    if bits.numel() == 0:
        return [str(t.dtype), list(t.shape)]
    n, k = bits.numel(), min(bits.numel(), 16)
    # integer spacing: float32 positions round past the last element of a tensor above 2^24 elements
    index = torch.arange(k, device=bits.device) * (n - 1) // max(k - 1, 1)
    return [str(t.dtype), list(t.shape), int(torch.sum(bits, dtype=torch.int64))] + bits[index].tolist()


def compare_outputs(expected: list, got: list, atol: float, rtol: float) -> str | None:
    """None when `got` matches `expected` (allclose; NaN/Inf exactly where expected), else why not."""
    if len(got) != len(expected):
        return f"forward returned {len(got)} tensor(s), the reference returns {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        label = f"output {i}" if len(expected) > 1 else "output"
        if g.device.type != e.device.type:
            return f"{label} is on {g.device.type}, the reference's is on {e.device.type}"
        if g.dtype != e.dtype:
            return f"{label} has dtype {str(g.dtype)[6:]}, expected {str(e.dtype)[6:]}"
        if g.shape != e.shape:
            return f"{label} has shape {list(g.shape)}, expected {list(e.shape)}"
        problem = _value_mismatch(e, g, atol, rtol)
        if problem:
            return f"{label}: {problem}"
    return None


def _value_mismatch(e: torch.Tensor, g: torch.Tensor, atol: float, rtol: float) -> str | None:
    if e.is_floating_point() or e.is_complex():
        # isclose with equal_nan: NaN only matches NaN, inf only the same inf.
        bad = ~torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
    else:
        bad = g != e
    n_bad = int(bad.sum())
    if n_bad == 0:
        return None
    first = _index(bad.reshape(-1).nonzero()[0].item(), e.shape)
    text = (f"{n_bad} of {e.numel()} elements differ beyond atol={atol:g}, rtol={rtol:g}; "
            f"first at {first} (got {g[first].item():.6g}, expected {e[first].item():.6g})")
    if e.is_floating_point():
        g32, e32 = g.float(), e.float()
        finite = torch.isfinite(g32) & torch.isfinite(e32)
        err = torch.where(finite, (g32 - e32).abs(), torch.zeros((), device=e.device))
        worst = _index(int(err.reshape(-1).argmax()), e.shape)
        rel = err / e32.abs().clamp_min(1e-6)
        text += (f"; max abs error {err[worst].item():.4g} at {worst} (got {g[worst].item():.6g}, "
                 f"expected {e[worst].item():.6g}); max rel error {rel.max().item():.4g}")
    return text


def _index(flat: int, shape) -> tuple:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))
