"""load_inline programs as text: the device/host split, cache-key normalisation.

torch's `load_inline` writes main.cpp for g++ and cuda.cu for nvcc (`torch_inline`); both parse
torch's headers, which is nearly all of a ~60 s build.

`split_program` cuts cuda.cu in two. The device unit (kernels, `__device__` functions and
variables, and the macros, types and constants both sides may use) is compiled by nvcc without
torch's headers, behind `DEVICE_PRELUDE`: standard and CUDA headers that torch/types.h itself
pulls in under nvcc. The host unit is the rest of cuda.cu (host wrappers, `<<<>>>` launches
rewritten into calls of launch shims the device unit defines) after either torch's main.cpp
verbatim (binding "pybind", on a precompiled torch/extension.h) or the cpp_sources on torch/types.h
with the generic binding's entries at the end (binding "dispatch", dispatch.h; every
`#include <torch/extension.h>` blanked), so one g++ run on a precompiled header replaces two full
parses. Anything the split cannot reproduce exactly raises `Unsplittable` and the caller builds
with torch's own load_inline: templated kernels, host code touching device symbols or kernels
outside a launch, device code naming torch, `#if` blocks or namespaces at file scope, cpp_sources
that hold more than function declarations (in the merged unit they would be visible to cuda.cu's
code).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .cxx import CxxError, Item, Token, directive, items, normalise, tokenize
from .torch_inline import TORCH_PREFIX, main_cpp

DEVICE_PRELUDE = ("cassert", "cstdint", "cstddef", "climits", "cfloat", "cmath", "cstdlib", "cstdio",
                  "cstring", "type_traits", "limits", "utility", "algorithm", "cuda_fp16.h", "cuda_bf16.h")
# of DEVICE_PRELUDE, kept only where the device code names what they declare: a third of a small unit's nvcc time
LAZY_HEADERS = ("algorithm", "cuda_fp16.h", "cuda_bf16.h")
TORCH_IDS = {"torch", "at", "c10", "caffe2", "pybind11", "py", "PyObject"}
TORCH_MACRO = re.compile(r"(C10|TORCH|AT|CAFFE2?|PYBIND11|THC|Py|PY)_\w*")
DEVICE_QUALIFIERS = {"__global__", "__device__", "__shared__", "__constant__", "__managed__"}
DEVICE_IDS = DEVICE_QUALIFIERS | {"threadIdx", "blockIdx", "blockDim", "gridDim", "warpSize",
                                  "cooperative_groups", "nvcuda", "wmma", "cub"}
NVCC_ONLY = {"__CUDACC__", "__NVCC__", "__CUDA_ARCH__", "__CUDACC_RDC__", "__CUDA_ARCH_LIST__",
             "__CUDACC_VER_MAJOR__", "__CUDACC_VER_MINOR__"}
HOST_HEADERS = re.compile(r"(torch|ATen|c10|caffe2|pybind11|THC)/.*|Python\.h|(cublas|cublasLt|cudnn|cusparse|"
                          r"cusolver|cufft|curand|nccl|nvrtc|cuda_profiler_api|nvToolsExt)\w*\.h|nvtx3/.*")
DEVICE_HEADERS = re.compile(r"cooperative_groups(\.h|/.*)|mma\.h|cub/.*|cuda/.*|cuda_pipeline\w*\.h|"
                            r"cuda_awbarrier\w*\.h|crt/.*|sm_\w+\.h|curand_\w+\.h")
DISPATCH_HEADER = Path(__file__).with_name("dispatch.h")
EXTENSION_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*[<\"]torch/extension\.h[>\"][ \t]*$", re.MULTILINE)
CPP_FORBIDDEN = {"static", "inline", "extern", "constexpr", "template", "typedef", "using", "namespace",
                 "friend", "operator", "=", "{", "__attribute__", "struct", "class", "union", "enum"}


class Unsplittable(Exception):
    """The program cannot be split exactly; `reason` is a short category, the message says where."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Kernel:
    name: str
    params: str              # the parameter list, tokens joined by spaces
    names: list[str]         # the parameters' names

    def host_shim(self) -> str:
        """Declaration of the device unit's launch shim plus the callable a rewritten launch builds:
        `k<<<g, b, s, st>>>(args)` becomes `__dice_config_k(g, b, s, st)(args)`, which, like
        nvcc's own expansion, evaluates the configuration before the arguments (C++17 sequences
        a call's postfix expression first) and converts each to the same parameter type."""
        k, params, args = self.name, self.params, "".join(f", {n}" for n in self.names)
        return (f"void __dice_launch_{k}(dim3, dim3, size_t, cudaStream_t{', ' * bool(params)}{params}); "
                f"struct __dice_call_{k} {{ dim3 __dice_g, __dice_b; size_t __dice_s; cudaStream_t __dice_t; "
                f"void operator()({params}) const {{ __dice_launch_{k}(__dice_g, __dice_b, __dice_s, "
                f"__dice_t{args}); }} }}; inline __dice_call_{k} __dice_config_{k}(dim3 __dice_g, dim3 __dice_b, "
                f"size_t __dice_s = 0, cudaStream_t __dice_t = 0) {{ return {{__dice_g, __dice_b, __dice_s, __dice_t}}; }}")

    def device_shim(self) -> str:
        """The launch shim: the very `<<<>>>` launch, compiled by nvcc next to the kernel."""
        params = f", {self.params}" if self.params else ""
        return (f"void __dice_launch_{self.name}(dim3 __dice_g, dim3 __dice_b, size_t __dice_s, cudaStream_t "
                f"__dice_t{params}) {{ {self.name}<<<__dice_g, __dice_b, __dice_s, __dice_t>>>"
                f"({', '.join(self.names)}); }}")


@dataclass
class Split:
    host: str                 # the g++ unit: torch's main.cpp or the cpp_sources, cuda.cu's host side
    device: str               # the nvcc unit
    main_lines: int           # the host unit's first main_lines lines are torch's main.cpp verbatim
    kernels: list[str] = field(default_factory=list)
    binding: str = "pybind"   # "pybind": torch's PYBIND11_MODULE; "dispatch": dispatch.h's entries
    declared: frozenset[str] = frozenset()   # every name the program's items declare, either side
    device_full: str = ""     # with a lean device unit (no LAZY_HEADERS): the unit with them, if that fails


def split_program(cpp_sources: list[str], cuda_sources: list[str], functions, with_pytorch_error_handling: bool,
                  cuda_file: str, torch_macros: frozenset[str] = frozenset(), cuda_defines: tuple[str, ...] = (),
                  binding: str = "pybind", lazy_names: frozenset[str] | None = None) -> Split:
    """The host and device units for one load_inline call, or Unsplittable.

    cuda_file: the path error messages and `__FILE__` should name for cuda.cu's lines;
    torch_macros: macros torch's headers define (device code must not depend on them);
    cuda_defines: `#define`/`#undef` lines standing for nvcc's -D/-U flags in the host unit;
    binding: "pybind" starts the host unit with torch's main.cpp; "dispatch" with the cpp_sources
    alone on torch/types.h (every `#include <torch/extension.h>` blanked) and ends it with
    `dispatch_entries`, for the generic binding (dispatch.h);
    lazy_names: what LAZY_HEADERS add to the prelude (`toolchain.lazy_names`; None: always kept).
    A device unit that names none of them is compiled without them (`Split.device_full` holds the
    unit with them, which a failed compile falls back to): what they add are types, functions,
    overloads and macros, and the unit can reach none of them without naming it (a value of a
    half-precision type needs that type's name or a function's; an overload of a name declared
    elsewhere matters only for arguments of such types, or fails the lean compile).
    """
    if isinstance(functions, dict) and any(re.search(r'["\\\n]', str(d)) for d in functions.values()):
        raise Unsplittable("arguments", "a docstring in functions holds quotes, backslashes or newlines")
    main = main_cpp(cpp_sources, functions, with_pytorch_error_handling)
    source = "\n".join(cuda_sources)
    if "__dice" in source or "__dice" in main:
        raise Unsplittable("reserved names", "the sources use the __dice prefix of the launch shims")
    try:
        parsed = [_classify(item) for item in items(tokenize(source))]
        cpp_names, cpp_includes = _cpp_declarations("\n".join(cpp_sources))
    except CxxError as exc:
        raise Unsplittable("unreadable source", str(exc)) from None
    kernels = _kernels(parsed)
    _check_sides(parsed, kernels, torch_macros, cpp_names, cpp_includes)
    _prune_device(parsed)
    host, device = _units(source, parsed, kernels)
    line = f'#line {len(TORCH_PREFIX) + 1} "{cuda_file}"'
    includes = [*cuda_defines, "#include <cuda_runtime.h>", *TORCH_PREFIX, "#include <cuda_fp16.h>",
                "#include <cuda_bf16.h>", line]
    device_unit, device_full = _device_units(device, line, lazy_names)
    declared = frozenset(cpp_names).union(*(p.names for p in parsed))
    if binding == "pybind":
        return Split("\n".join([main, *includes, host]), device_unit, main.count("\n") + 1, sorted(kernels),
                     declared=declared, device_full=device_full)
    declarations = EXTENSION_INCLUDE.sub("", "\n".join([f'#include "{DISPATCH_HEADER}"', *cpp_sources]))
    host_unit = "\n".join([declarations, *includes, EXTENSION_INCLUDE.sub("", host),
                           dispatch_entries(functions, with_pytorch_error_handling, cpp_names)])
    return Split(host_unit, device_unit, 0, sorted(kernels), "dispatch", declared, device_full)


def _device_units(device: str, line: str, lazy_names: frozenset[str] | None) -> tuple[str, str]:
    """(the device unit, "") or, where the device code names nothing of `lazy_names`, (the unit
    without LAZY_HEADERS, the unit with them); `line` starts the program's own lines."""
    def unit(headers) -> str:
        return "\n".join([*(f"#include <{h}>" for h in headers), *TORCH_PREFIX[1:], line, device])

    full = unit(DEVICE_PRELUDE)
    if lazy_names is None or not lazy_names.isdisjoint(re.findall(r"[A-Za-z_]\w*", device)):
        return full, ""
    return unit(h for h in DEVICE_PRELUDE if h not in LAZY_HEADERS), full


def dispatch_entries(functions, with_pytorch_error_handling: bool, declared: set[str]) -> str:
    """The `__dice_entries` table dispatch.cpp reads: one DICE_ENTRY per bound function. Each
    must be declared by cpp_sources: torch's main.cpp binds it there, before cuda.cu's code."""
    names = list(functions) if isinstance(functions, (list, dict)) else [functions]
    if not names or not all(isinstance(n, str) and re.fullmatch(r"[A-Za-z_]\w*", n) for n in names):
        raise Unsplittable("arguments", "functions must name C++ functions by plain identifiers")
    if set(names) - declared:
        raise Unsplittable("arguments", f"cpp_sources does not declare {sorted(set(names) - declared)[0]}")
    entries = ", ".join(f"DICE_ENTRY({n}, {int(with_pytorch_error_handling)})" for n in names)
    return (f'#line 1 "dice_entries.cpp"\nextern "C" __attribute__((visibility("default"))) const dice_binding::Entry* '
            f"__dice_entries(int* __dice_count) {{ static const dice_binding::Entry __dice_table[] = {{{entries}}}; "
            f"*__dice_count = {len(names)}; return __dice_table; }}\n")


@dataclass
class _Part:
    item: Item
    side: str                 # "host", "device", "both", "drop"
    names: set[str]           # names it declares
    kernel: Kernel | None = None


def _classify(item: Item) -> _Part:
    """Which unit an item of cuda.cu belongs to."""
    if item.directive:
        return _classify_directive(item)
    words = [t.text for t in item.head]
    if words[:1] == ["namespace"] or (words[:1] == ["extern"] and item.body_after_string):
        raise Unsplittable("namespace or extern block", f"line {item.line}")
    if words[:1] == ["template"] and "__global__" in item.ids:
        raise Unsplittable("templated kernel", f"line {item.line}")
    if "__global__" in words:
        return _Part(item, "device", {item.name}, _kernel(item))
    if DEVICE_QUALIFIERS & set(words):
        return _Part(item, "device", item.declared)
    definable = words[:1] in (["typedef"], ["using"], ["static_assert"]) or "constexpr" in words or item.is_type \
        or item.is_const_value
    if not definable:
        return _Part(item, "host", item.declared)
    if item.ids & TORCH_IDS or any(TORCH_MACRO.fullmatch(i) for i in item.ids):
        return _Part(item, "host", item.declared)
    return _Part(item, "device" if item.ids & DEVICE_IDS else "both", item.declared)


def _classify_directive(item: Item) -> _Part:
    name, rest = directive(item.tokens[0])
    if name == "include":
        header = rest.strip()[1:-1].strip()
        if HOST_HEADERS.fullmatch(header):
            return _Part(item, "host", set())
        return _Part(item, "device" if DEVICE_HEADERS.fullmatch(header) else "both", set())
    if name in ("define", "undef"):
        if "<<<" in rest:
            raise Unsplittable("launch inside a macro", f"line {item.line}")
        if item.ids & {"__CUDACC__", "__NVCC__"}:
            raise Unsplittable("nvcc macros in host code", f"line {item.line}")
        return _Part(item, "both", set())
    if name == "pragma":
        return _Part(item, "drop" if rest.split() == ["once"] else "both", set())
    raise Unsplittable("preprocessor conditional or directive at file scope", f"#{name} on line {item.line}")


def _kernel(item: Item) -> Kernel:
    if item.param_tokens is None or any(t.kind == "pp" for t in item.param_tokens):
        raise Unsplittable("kernel parameters", f"the kernel on line {item.line}")
    params, names, current = [], [], []
    for t in item.param_tokens + [Token("punct", ",", 0, 0)]:
        if t.text == "," and current:
            params.append(current)
            current = []
        else:
            current.append(t)
    if [t.text for t in item.param_tokens] in ([], ["void"]):
        params = []
    for p in params:
        words = [t.text for t in p]
        if any(w in ("=", "[", "<", "(", "...") for w in words) or p[-1].kind != "id" or len(p) < 2 \
                or all(w in ("const", "volatile", "struct", "class", "typename", "::") for w in words[:-1]) \
                or words[-2] == "::":
            raise Unsplittable("kernel parameters", f"{item.name}: {' '.join(words)}")
        names.append(words[-1])
    return Kernel(item.name, ", ".join(" ".join(t.text for t in p) for p in params), names)


def _kernels(parts: list[_Part]) -> dict[str, Kernel]:
    kernels: dict[str, Kernel] = {}
    for part in parts:
        k = part.kernel
        if k is None:
            continue
        if k.name in kernels and kernels[k.name].params != k.params:
            raise Unsplittable("overloaded kernel", k.name)
        kernels.setdefault(k.name, k)
    return kernels


def _check_sides(parts: list[_Part], kernels: dict[str, Kernel], torch_macros: frozenset[str],
                 cpp_names: set[str], cpp_includes: set[str]) -> None:
    """Refuse programs whose split could compile or compute differently from torch's build."""
    own_macros = {m.group(1) for p in parts if p.item.directive
                  for m in [re.match(r"#\s*(?:define|undef)\s+(\w+)", p.item.tokens[0].text)] if m}
    torch_macros = torch_macros - own_macros   # the program's own definitions win in both units
    device_names = set().union(*(p.names for p in parts if p.side == "device"))
    host_names = set().union(*(p.names for p in parts if p.side == "host"))
    if device_names & host_names:
        raise Unsplittable("name on both sides", ", ".join(sorted(device_names & host_names)[:3]))
    extension_seen, pending = False, set(cpp_names)
    for part in parts:
        item = part.item
        if item.directive and item.header == "torch/extension.h":
            extension_seen = True
        if item.directive and item.header:
            cpp_includes.discard(item.header)
        if part.side in ("device", "both"):
            bad = item.ids & TORCH_IDS or item.ids & torch_macros or {i for i in item.ids if TORCH_MACRO.fullmatch(i)}
            if bad and part.side == "device":
                raise Unsplittable("device code uses torch/ATen/c10", f"{sorted(bad)[0]} on line {item.line}")
        if part.side in ("host", "both") and not item.directive:
            if not extension_seen:
                raise Unsplittable("host code before #include <torch/extension.h>", f"line {item.line}")
            if cpp_includes:   # main.cpp's includes would reach this code before cuda.cu's own do
                raise Unsplittable("cpp_sources includes a header cuda_sources does not", sorted(cpp_includes)[0])
            used = item.ids - part.names
            if used & pending:
                raise Unsplittable("cpp_sources declares a function cuda_sources uses before declaring it",
                                   sorted(used & pending)[0])
            pending -= part.names
        if part.side == "host":
            _check_host(item, kernels, device_names)
    if not extension_seen:
        raise Unsplittable("cuda_sources does not include torch/extension.h")


def _check_host(item: Item, kernels: dict[str, Kernel], device_names: set[str]) -> None:
    if item.ids & (NVCC_ONLY | DEVICE_IDS):
        raise Unsplittable("CUDA device code in host code", f"{sorted(item.ids & (NVCC_ONLY | DEVICE_IDS))[0]} "
                           f"on line {item.line}")
    toks = item.tokens
    launched = {i - 1 for i, t in enumerate(toks) if t.text == "<<<"}
    for i, t in enumerate(toks):
        if t.text == "<<<" and (i == 0 or toks[i - 1].text not in kernels or
                                (i > 1 and toks[i - 2].text in ("::", ".", "->"))):
            raise Unsplittable("launch of a kernel the split cannot resolve", f"line {item.line}")
        if t.kind == "id" and t.text in device_names and i not in launched:
            what = "kernel used outside a <<<>>> launch" if t.text in kernels else "device symbol used by host code"
            raise Unsplittable(what, f"{t.text} on line {item.line}")
        if t.kind == "pp" and "<<<" in t.text:
            raise Unsplittable("launch inside a macro", f"line {item.line}")


def _cpp_declarations(text: str) -> tuple[set[str], set[str]]:
    """(names declared, headers included) by cpp_sources, which must hold only function
    declarations: anything more would also be seen by cuda.cu's code in the merged unit."""
    names, includes = set(), set()
    for item in items(tokenize(text)):
        if item.directive:
            name, rest = directive(item.tokens[0])
            if name == "pragma" and rest.split() == ["once"]:
                continue
            if name != "include":
                raise Unsplittable("cpp_sources not only declarations", f"#{name}")
            if item.header != "torch/extension.h":
                includes.add(item.header)
            continue
        words = [t.text for t in item.tokens]
        if CPP_FORBIDDEN & set(words) or item.param_tokens is None or words[-1] != ";":
            raise Unsplittable("cpp_sources not only declarations", " ".join(words)[:80])
        names.add(item.name)
    return names, includes


def _prune_device(parts: list[_Part]) -> None:
    """Types, aliases and constants both units could hold go to the device unit only when device
    code names them (a deleter struct over cuDNN types is host code); `using` directives and
    declarations always do, since they change lookup without being named."""
    needed = set().union(*(p.item.ids for p in parts if p.side == "device"))
    for part in reversed(parts):
        words = [t.text for t in part.item.tokens]
        if part.side != "both" or part.item.directive or words[:1] == ["using"] and "=" not in words:
            continue
        if part.names & needed:
            needed |= part.item.ids
        else:
            part.side = "host"


def _units(source: str, parts: list[_Part], kernels: dict[str, Kernel]) -> tuple[str, str]:
    """cuda.cu's text for each unit: items of the other side blanked (line numbers kept), kernels
    replaced by their shims' declarations on the host side, launches rewritten."""
    host, device, at, shimmed = [], [], 0, set()
    for part in parts:
        start, end = part.item.start, part.item.end
        gap = source[at:start]
        host.append(gap)
        device.append(gap)
        text = source[start:end]
        blank = "\n" * text.count("\n")
        kernel = part.kernel if part.kernel and part.kernel.name not in shimmed else None
        if kernel:
            shimmed.add(kernel.name)
        host.append(kernel.host_shim() + blank if kernel else
                    _rewrite_launches(source, part.item, kernels) if part.side in ("host", "both") else blank)
        device.append(text + " " + kernel.device_shim() if kernel else
                      text if part.side in ("device", "both") else blank)
        at = end
    host.append(source[at:])
    device.append(source[at:])
    return "".join(host), "".join(device)


def _rewrite_launches(source: str, item: Item, kernels: dict[str, Kernel]) -> str:
    """The item's text with each `k<<<config>>>` replaced by `__dice_config_k(config)`."""
    out, at, toks = [], item.start, item.tokens
    for i, t in enumerate(toks):
        if t.text != "<<<":
            continue
        depth, j = 0, i + 1
        while j < len(toks) and not (depth == 0 and toks[j].text == ">>>"):
            depth += toks[j].text in "([{" and toks[j].kind == "punct"
            depth -= toks[j].text in ")]}" and toks[j].kind == "punct"
            j += 1
        if j + 1 >= len(toks) or toks[j + 1].text != "(":
            raise Unsplittable("launch configuration", f"line {item.line}")
        name = toks[i - 1]
        out += [source[at:name.start], f"__dice_config_{name.text}(", source[t.end:toks[j].start], ")"]
        at = toks[j].end
    out.append(source[at:item.end])
    return "".join(out)


__all__ = ["DEVICE_PRELUDE", "Split", "Unsplittable", "normalise", "split_program"]
