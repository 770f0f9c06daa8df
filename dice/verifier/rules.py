"""What a candidate must satisfy, as plain functions (DESIGN.md §8).

Source rules (run in the parent, on text): whether the source declares a `__global__` kernel at
all (a cheap first filter; which kernels are the candidate's own is decided from machine code,
`kernels.CompiledKernels`) and try/except fallbacks to PyTorch. The kernel rule (run in the
parent on what the profiler recorded): `kernel_problem`. Tensor rules (run in the workers):
exact equality, inputs modified, outputs sharing memory with inputs, fingerprints for spotting
cached outputs, and the comparison with the reference (`compare_outputs`: allclose plus a
relative error of the whole output).

`trusted` holds the torch/time functions the verifier relies on, captured when this module is
imported, which a worker does before it runs any candidate code; `replaced_functions()` names the
ones a candidate has since replaced (the worker then reports `invalid` and is recycled).
"""

from __future__ import annotations

import ast
import collections
import importlib
import os
import re
import time
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
    perf_counter=time.perf_counter,
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
    urandom=os.urandom,
    to_host=torch.Tensor.cpu,
    marker=torch.cuda._sleep,
    cuda_activity=torch.profiler.ProfilerActivity.CUDA,
    cuda_device_type=torch.autograd.DeviceType.CUDA,
)


class HarnessTampered(RuntimeError):
    """Raised by the harness when it finds its own state changed by candidate code (`invalid`)."""


def trusted_intact(_frozen: tuple = tuple(vars(trusted).items())) -> bool:
    """Whether every function in `trusted` is still the one captured at import (checked right
    before a timing loop binds them to locals: a wrapper that puts the original back once it has
    been called is caught before it can be)."""
    return len(vars(trusted)) == len(_frozen) and all(getattr(trusted, k, None) is v for k, v in _frozen)


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
    {"dtoh", "htod"} counts; qualify: profiler name -> qualified name (`kernels.qualified_name`);
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


def timed_kernel_problem(launched: dict, own: set, reference: dict, calls: int, qualify,
                         epilogues: dict | None = None) -> str | None:
    """Why the kernels of `calls` eager timed calls break the rule, or None: an own kernel ran,
    and no library compute beyond what `calls` forwards of the reference run (a candidate that
    used a faster library op only when it was being timed would gain by it)."""
    reference_names = {qualify(k) for k in reference}
    if not any(n and qualify(k) in own and qualify(k) not in reference_names for k, n in launched.items()):
        return "no kernel the candidate compiled ran in its timed calls"
    epilogues = epilogues or {}
    ref_classes = {kernel_class(k, epilogues.get(k, ())) for k in reference}
    ref = collections.Counter()
    for k, n in reference.items():
        ref[kernel_class(k, epilogues.get(k, ()))] += n
    used = collections.Counter()
    for k, n in launched.items():
        if not (qualify(k) in own and qualify(k) not in reference_names) and not BOOKKEEPING.search(k):
            used[_as_reference_gemm(kernel_class(k, epilogues.get(k, ())), ref_classes)] += n
    added = [k for k, n in used.items() if n > calls * ref[k]]
    return (f"its timed calls run library compute the reference does not ({added[0][:80]})" if added else None)


WORK_SHARE = 0.75       # a timed call runs at least this share of the lightest checked trial's kernel time
WORK_SLACK_MS = 0.003   # per call: kernel durations of microsecond kernels jitter by this much


def timed_work_problem(activity: dict, calls: int, trials: list[dict]) -> str | None:
    """Why `calls` timed calls (their GPU `activity`) ran less work than the correctness trials,
    or None (DESIGN.md §8.3): each call must keep the GPU busy for at least WORK_SHARE of the
    busy time of the lightest trial (the same shapes; the trials' outputs were all checked), so a
    forward that skips work when it is timed, where its outputs might not be compared, is caught.
    Busy time is the union of the kernels' intervals on the GPU's own records (`records.activity`):
    padding kernels run side by side on parallel streams count once."""
    if not trials:
        return None
    checked = min(t["busy_ms"] for t in trials)
    timed = activity["busy_ms"] / calls
    if timed < WORK_SHARE * checked - WORK_SLACK_MS:
        return (f"its timed calls kept the GPU busy {timed:.4g} ms each, its checked trials {checked:.4g} ms: "
                "forward must do the same work on every call")
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


def compare_outputs(expected: list, got: list, atol: float = 1e-2, rtol: float = 1e-2, rel_l2: float = 1e-2,
                    per_output: list | None = None) -> str | None:
    """None when `got` matches `expected`, else why not: allclose(atol, rtol) with NaN/Inf exactly
    where expected, and for floating outputs also ||g - e||_2 <= rel_l2 * ||e||_2 over the finite
    elements (`relative_error`; complex outputs too), so that an output whose true values all sit
    below atol (a softmax over 65,536 columns) cannot pass with values of the wrong size. `per_output`:
    [atol, rtol, rel_l2] for each output instead (`precision.tolerances`)."""
    if len(got) != len(expected):
        return f"forward returned {len(got)} tensor(s), the reference returns {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        if per_output is not None:
            atol, rtol, rel_l2 = per_output[i]
        label = f"output {i}" if len(expected) > 1 else "output"
        if g.device.type != e.device.type:
            return f"{label} is on {g.device.type}, the reference's is on {e.device.type}"
        if g.dtype != e.dtype:
            return f"{label} has dtype {str(g.dtype)[6:]}, expected {str(e.dtype)[6:]}"
        if g.shape != e.shape:
            return f"{label} has shape {list(g.shape)}, expected {list(e.shape)}"
        problem = layout_problem(e, g)
        if problem:
            return f"{label} {problem}"
        problem = _value_mismatch(e, g, atol, rtol)
        if problem:
            return f"{label}: {problem}"
        if (e.is_floating_point() or e.is_complex()) and e.numel():
            rel = relative_error(e, g)
            if rel > rel_l2:
                return (f"{label}: relative error {rel:.3g} of the whole output (||got - expected|| / ||expected||) "
                        f"exceeds {rel_l2:g}, although every element is within atol={atol:g}, rtol={rtol:g}")
    return None


def layout_problem(e: torch.Tensor, g: torch.Tensor) -> str | None:
    """Why output `g` is laid out in memory as no caller of the reference expects, or None: it must
    be contiguous or have the reference's strides (dimensions of size 1 aside). A stride-0
    `expand` of one computed row, or a view into a smaller buffer, holds the right values for a
    reader but not a full tensor: it skipped the writes, and writing into it changes other elements."""
    if g.numel() <= 1 or g.is_contiguous():
        return None
    if all(a == b for n, a, b in zip(g.shape, g.stride(), e.stride()) if n > 1):
        return None
    return (f"has strides {list(g.stride())}, neither contiguous nor the reference's {list(e.stride())}; "
            "return a full tensor (a stride-0 expand or a view of a smaller buffer is not one)")


def relative_error(e: torch.Tensor, g: torch.Tensor, chunk: int = 2**24) -> float:
    """||g - e|| / ||e|| in float64 over the elements where both are finite (in chunks: outputs of
    10^8 elements stay affordable; complex values as their real and imaginary parts); 0 for an
    all-zero reference, where allclose alone decides."""
    if e.is_complex():
        e, g = torch.view_as_real(e), torch.view_as_real(g)
    diff2 = ref2 = 0.0
    e_flat, g_flat = e.reshape(-1), g.reshape(-1)
    for start in range(0, e_flat.numel(), chunk):
        e64, g64 = e_flat[start:start + chunk].double(), g_flat[start:start + chunk].double()
        finite = torch.isfinite(e64) & torch.isfinite(g64)
        diff2 += float(torch.where(finite, g64 - e64, 0.0).square().sum())
        ref2 += float(torch.where(finite, e64, 0.0).square().sum())
    return (diff2 / ref2) ** 0.5 if ref2 > 0 else 0.0


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
