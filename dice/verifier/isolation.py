"""Candidates kept apart: which candidates leave a worker process that the next may use (DESIGN.md §8.4).

A worker serves candidates one after another, and whatever one leaves in the process (a patched
function, a memory cap, a thread, a kernel cache entry, a state of the CUDA context) meets the
next, a sibling of the same RL group among them. No check inside the process can prove that
nothing was left: code that reached native memory (ctypes, a compiled extension, numpy's
`__array_interface__` over an address, CuPy's runtime calls) can change anything without a trace.
So the trusted side decides, from the candidate's source alone (`reuse_problem`, run in the
trainer): a worker is used again only after a candidate written in PLAIN Python, one that cannot
reach the interpreter, native memory or process-wide settings:
- imports only from IMPORTS (torch, its nn and functional, CuPy, math, numpy);
- reads no attribute that starts with "_" (bar `__init__` through super()) and none of NATIVE
  (load_inline and other compiled code, CuPy's and torch's runtime handles, raw pointers to memory,
  strided views of host memory), and calls no setter of process-wide state (SETTERS: `set_`,
  `register_`, ... on anything but its own objects);
- assigns only to its own names and to attributes and items of objects it reaches from `self` or
  its own names, never to a module's;
- calls none of the builtins in DYNAMIC (getattr, eval, exec, open, __import__, ...) and defines no
  method of the data model but `__init__` (a `__del__` runs during the next candidate).
Any other candidate's worker is replaced by a fresh process after it (`Verifier._release`). What a
plain candidate can still change: GPU memory through a wild pointer in its own kernels (all GPU
code can), and the worker resets the torch settings a candidate may change (`restore_global_flags`).
"""
from __future__ import annotations

import ast

import torch

from ..tasks.load import parse_python

IMPORTS = frozenset({"torch", "torch.nn", "torch.nn.functional", "cupy", "math", "numpy"})
NATIVE = frozenset({
    "load_inline", "load", "cpp_extension", "utils", "ctypes", "ctypeslib", "cdll", "CDLL", "runtime", "driver",
    "nvrtc", "profiler", "cudart", "library", "Library", "jit", "compile", "hub", "as_strided", "frombuffer",
    "from_file", "fromfile", "memmap", "UnownedMemory", "MemoryPointer", "PinnedMemoryPointer", "memory",
    "multiprocessing", "distributed", "backends", "environ", "system"})
SETTERS = ("set_", "register_", "use_", "enable_", "disable_", "reset_", "change_", "load_")
DYNAMIC = frozenset({"getattr", "setattr", "delattr", "vars", "globals", "locals", "eval", "exec", "compile",
                     "__import__", "open", "breakpoint", "input", "memoryview", "type", "dir"})


def reuse_problem(source: str) -> str | None:
    """Why a worker that ran `source` must not serve another candidate (module docstring), or None
    when the source is plain Python that leaves nothing behind."""
    try:
        tree = parse_python(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "the source does not parse"
    modules = set()
    for node in ast.walk(tree):
        problem = _node_problem(node, modules)
        if problem:
            return f"line {getattr(node, 'lineno', '?')}: {problem}"
    return None


def _node_problem(node: ast.AST, modules: set) -> str | None:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if isinstance(node, ast.ImportFrom) and (node.level or any(a.name == "*" for a in node.names)):
            return "a relative or star import"
        outside = [n for n in names if n not in IMPORTS]
        if outside:
            return f"imports {outside[0]}"
        modules.update(a.asname or a.name.split(".")[0] for a in node.names)
        return None
    if isinstance(node, ast.Attribute):
        if node.attr.startswith("_") and node.attr != "__init__":
            return f"reads the attribute {node.attr}"
        if node.attr in NATIVE:
            return f"reaches {node.attr}"
        if node.attr.startswith(SETTERS) and not _own(node.value, modules):
            return f"calls {node.attr} on something not its own"
        return None
    if isinstance(node, ast.Name) and node.id in DYNAMIC:
        return f"uses {node.id}"
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for target in (t for outer in targets for t in _flat(outer)):
            if not isinstance(target, ast.Name) and not _own(target, modules):
                return f"assigns to {ast.unparse(target)[:60]}, which is not its own"
        return None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("__") \
            and node.name != "__init__":
        return f"defines {node.name}"
    if isinstance(node, ast.ClassDef) and node.keywords:
        return "a class with a metaclass or keywords"
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return "a global or nonlocal statement"
    return None


def _flat(target: ast.AST) -> list:
    return [t for e in target.elts for t in _flat(e)] if isinstance(target, (ast.Tuple, ast.List)) else [target]


def _own(expr: ast.AST, modules: set) -> bool:
    """Whether `expr` (a.b[c].d) starts from a name of the candidate's own, not an imported module."""
    while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call, ast.Starred)):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return isinstance(expr, ast.Name) and expr.id not in modules


def global_flags() -> dict:
    """Process-wide torch settings a candidate may change; restored between candidates."""
    return {"default_dtype": torch.get_default_dtype(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cudnn_deterministic": torch.backends.cudnn.deterministic}


def restore_global_flags(flags: dict) -> None:
    torch.set_default_dtype(flags["default_dtype"])
    torch.set_float32_matmul_precision(flags["matmul_precision"])
    torch.backends.cuda.matmul.allow_tf32 = flags["tf32_matmul"]
    torch.backends.cudnn.allow_tf32 = flags["tf32_cudnn"]
    torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = flags["cudnn_deterministic"]
