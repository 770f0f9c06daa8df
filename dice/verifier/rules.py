"""What a candidate must satisfy, as plain functions (DESIGN.md §8); the tensor rules are in `outputs`.

Source rules (run in the parent, on text): whether the source declares a `__global__` kernel at
all (a cheap first filter; which kernels are the candidate's own is decided from machine code,
`kernels.CompiledKernels`) and try/except fallbacks to PyTorch. The kernel rule (run in the
parent on what the profiler recorded): `kernel_problem`.

`trusted` holds the torch/time functions the verifier relies on, captured when this module is
imported, which a worker does before it runs any candidate code; `replaced_functions()` names the
ones a candidate has since replaced (the worker then reports `invalid` and is recycled).
"""

from __future__ import annotations

import ast
import collections
import importlib
import re
import types

import torch
import torch._dynamo  # noqa: F401  importing dynamo wraps torch.manual_seed: capture after it
from torch._C import _autograd, _profiler

WATCHED = (
    "torch.allclose", "torch.isclose", "torch.equal", "torch.manual_seed", "torch.no_grad",
    "torch.cuda.synchronize", "torch.cuda.current_stream", "torch.cuda.Event",
    "torch.cuda.Event.record", "torch.cuda.Event.elapsed_time", "torch.Tensor.clone",
    "torch.Tensor.data_ptr", "torch.Tensor.untyped_storage", "torch.nn.Module.__call__",
    "torch.profiler.profile", "time.perf_counter", "os.urandom",
)
# Kernels from these namespaces, and with these names (cuBLAS, cuBLASLt and cuDNN kernels), are
# library code whatever compiled them.
LIBRARY_NAMESPACES = ("at", "c10", "cub", "thrust", "cutlass", "cute", "cudnn", "cublas", "cublasLt", "std")
LIBRARY_NAMES = re.compile(r"^(sm\d+_xmma|nvjet|ampere_|volta_|turing_|hopper_|maxwell_|blackwell_|implicit_convolve|"
                           r"precomputed_convolve|fft2d_|cublas|cudnn|gemv2|gemvx|gemmk1|splitKreduce)")
GEMM = re.compile(r"gemm|gemv|xmma|nvjet|cutlass|cublas|splitK|sm\d+_.*_(nn|nt|tn|tt)_", re.IGNORECASE)
CONV = re.compile(r"conv|fprop|dgrad|wgrad|cudnn|winograd|implicit_", re.IGNORECASE)
# Fused attention is no GEMM, whatever its name holds (`fmha_cutlassF_...`: "cutlass")
ATTENTION = re.compile(r"fmha|flash|attention|attn|mha|softmax", re.IGNORECASE)
# what a GEMM kernel's name says its epilogue computed (cuBLASLt's bias / activation epilogues)
EPILOGUES = ("bias", "relu", "gelu", "silu", "swish", "sigmoid", "tanh", "elu", "clamp")
# Data movement and initialisation: honest kernels add them (torch.zeros, .contiguous(), casts,
# cat); they never count as library compute of the candidate's own.
BOOKKEEPING = re.compile(r"FillFunctor|fill_kernel|direct_copy_kernel|copy_kernel|CatArrayBatchedCopy|"
                         r"cupy_copy|cupy_fill|memset|unrolled_elementwise_kernel<.*copy", re.IGNORECASE)
FILLS = re.compile(r"fill|memset", re.IGNORECASE)
# reference steps a library copy or fill can redo: a flip or a gather is data movement, a masked
# fill is a fill (`kernel_problem` does not count them as replaced when such kernels were added)
MOVES = re.compile(r"flip|roll|transpose|permute|index|gather|scatter|cat|repeat|pad|narrow|slice|select|unfold|"
                   r"im2col|copy", re.IGNORECASE)
FILL_STEPS = re.compile(r"masked|fill|where|tril|triu|zero", re.IGNORECASE)

trusted = types.SimpleNamespace(
    clone=torch.Tensor.clone,
    equal=torch.equal,
    manual_seed=torch.manual_seed,
    no_grad=torch.no_grad,
    cuda_synchronize=torch.cuda.synchronize,
    Event=torch.cuda.Event,
    event_record=torch.cuda.Event.record,
    event_elapsed_time=torch.cuda.Event.elapsed_time,
    untyped_storage=torch.Tensor.untyped_storage,
    # the profiler's own entry points: the candidate's worker replaces the public names (`guard`)
    prepare_profiler=_autograd._prepare_profiler,
    enable_profiler=_autograd._enable_profiler,
    disable_profiler=_autograd._disable_profiler,
    profiler_config=_profiler.ProfilerConfig,
    experimental_config=_profiler._ExperimentalConfig,
    kineto=_profiler.ProfilerState.KINETO,
    kineto_events=_autograd._ProfilerResult.events,
    event_name=_autograd._KinetoEvent.name,
    event_device_type=_autograd._KinetoEvent.device_type,
    event_start_ns=_autograd._KinetoEvent.start_ns,
    event_end_ns=_autograd._KinetoEvent.end_ns,
    event_correlation=_autograd._KinetoEvent.correlation_id,
    to_host=torch.Tensor.cpu,
    marker=torch.cuda._sleep,
    cuda_activity=torch.profiler.ProfilerActivity.CUDA,
    cuda_device_type=torch.autograd.DeviceType.CUDA,
)


class HarnessTampered(RuntimeError):
    """Raised by the harness when it finds its own state changed by candidate code (`invalid`)."""


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


def is_library_name(qualified: str) -> bool:
    """Whether a kernel's qualified name belongs to a library (namespaces, GEMM/convolution names)."""
    return qualified.split("::")[0] in LIBRARY_NAMESPACES or bool(LIBRARY_NAMES.search(qualified))


def kernel_class(name: str, epilogue=()) -> str:
    """The key under which launches are compared with the reference's: a GEMM is "gemm" plus the
    epilogue its name shows ("gemm+bias+relu") or `epilogue` names (what the judge saw it compute,
    `epilogues.activation_kernels`), a convolution "conv" (cuBLAS and cuDNN pick among many
    kernels by shape and layout, so an honest candidate that keeps the reference's GEMM may launch
    another of them), data movement "copy" or "fill", any other kernel its name without spaces (a
    fused attention kernel is its own, though its name may hold "cutlass")."""
    if GEMM.search(name) and not ATTENTION.search(name):
        words = set(re.split(r"[^a-z0-9]+", name.lower())) | set(epilogue)
        return "+".join(["gemm", *(e for e in EPILOGUES if e in words)])
    if CONV.search(name) and not ATTENTION.search(name):
        return "conv"
    if BOOKKEEPING.search(name):
        return "fill" if FILLS.search(name) else "copy"
    return re.sub(r"\s+", "", name)


def _as_reference_gemm(key: str, reference: set) -> str:
    """A candidate's GEMM class as the reference GEMM that covers it (whose epilogue includes all
    of its own: a plain GEMM where the reference's adds a bias is the reference's), else itself."""
    if not key.startswith("gemm"):
        return key
    mine = set(key.split("+")[1:])
    covering = sorted((k for k in reference if k.startswith("gemm") and mine <= set(k.split("+")[1:])), key=len)
    return covering[0] if covering else key


def _steps(launches: dict, reference: set, skip=lambda name: False,
           epilogues: dict | None = None) -> collections.Counter:
    """Launches by `kernel_class`, GEMM classes as the reference's that cover them, a GEMM or a
    convolution counted once per forward (cuBLAS may split one product in two)."""
    counts = collections.Counter()
    for k, n in launches.items():
        if not skip(k):
            counts[_as_reference_gemm(kernel_class(k, (epilogues or {}).get(k, ())), reference)] += n
    for k in counts:
        if k.startswith(("gemm", "conv")):
            counts[k] = min(counts[k], 1)
    return counts


def kernel_problem(launched: dict, own: set, reference: dict, copies: dict, reference_copies: dict,
                   qualify, rules: str = "strict", epilogues: dict | None = None) -> str | None:
    """Why a forward's kernels break the rule, or None (DESIGN.md §8.1).

    launched / reference: {kernel name: launches} of the candidate's and the reference's forward
    on the same inputs; own: qualified names of the kernels the candidate compiled; copies:
    {"dtoh", "htod"} counts; qualify: profiler name -> qualified name (`kernel_names.qualified_name`);
    epilogues: {library GEMM kernel: activations its epilogue computes} (`epilogues`).
    A launched kernel is the candidate's own when its qualified name is one it compiled, is no
    library name, and no kernel of the reference has it (a name shared with the reference is
    the reference's). Rules:
    - "kernelbench": at least one own kernel ran;
    - "strict" (the default and the RL reward): an own kernel ran; every library kernel it ran
      that is not data movement (BOOKKEEPING) is one the reference runs, at most as often, a GEMM
      with no epilogue the reference's lacks (it added no library compute); it ran fewer of some
      reference kernel than the reference does (it replaced a compute step: a GEMM kept in
      PyTorch with an own fused epilogue passes, a decoy kernel beside the reference's own ops
      does not), where a data-movement step (a flip, a gather) does not count as replaced when
      the candidate added library copies, nor a fill step (a masked fill) when it added fills:
      those may have redone it; and no data went to the host when the reference keeps it on the
      device (a host computation, read back by a copy or through mapped memory)."""
    reference_names = {qualify(k) for k in reference}
    mine = {k: n for k, n in launched.items()
            if qualify(k) in own and qualify(k) not in reference_names and not is_library_name(qualify(k))}
    if not mine:
        shown = ", ".join(k[:70] for k in sorted(launched)[:4]) or "none"
        return (f"none of the kernels that ran is one the candidate compiled (kernels launched: {shown}); "
                "ModelNew must compute with its own CUDA kernels")
    if rules == "kernelbench":
        return None
    epilogues = epilogues or {}
    ref_classes = {kernel_class(k, epilogues.get(k, ())) for k in reference}
    theirs = {k: n for k, n in launched.items() if k not in mine}
    ref = _steps(reference, ref_classes, epilogues=epilogues)
    library = _steps(theirs, ref_classes, epilogues=epilogues)
    compute = _steps(theirs, ref_classes, skip=lambda k: bool(BOOKKEEPING.search(k)), epilogues=epilogues)
    added = [k for k, n in compute.items() if n > ref[k]]
    if added:
        return (f"the forward runs library compute the reference does not ({added[0][:80]}); ModelNew "
                "may keep the reference's library calls, not add its own")
    redone = {"copy": library["copy"] > ref["copy"], "fill": library["fill"] > ref["fill"]}
    replaced = [k for k, n in ref.items() if n > library[k]
                and not (redone["copy"] and MOVES.search(k)) and not (redone["fill"] and FILL_STEPS.search(k))]
    if ref and not replaced:
        return ("every compute step of the reference still runs as a library kernel beside the candidate's own "
                f"({', '.join(sorted(mine))[:80]}), or was redone by a library copy or fill: its own kernels "
                "replace nothing (a decoy)")
    if copies.get("dtoh") and not reference_copies.get("dtoh"):
        return ("the forward copies data to the host, which the reference does not: ModelNew must compute on "
                "the GPU")
    return None


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
