"""Which CUDA kernels ran during a forward, and which of them the candidate compiled itself (DESIGN.md §8).

`gpu_records(fn)` runs `fn` under the CUDA profiler (CUPTI through torch's profiler) and returns
what the GPU and the CUDA runtime recorded, raw; `records` counts kernels and copies (CUPTI
records no byte counts in this torch, so copies are counted, not measured) and matches every
launch with its device record, where the candidate's code does not run.

`CompiledKernels` is the provenance side: the names of the `__global__` entry points in the code
the candidate actually compiled, read from the machine code, never from source text (a
`__global__` declaration in a string that is never compiled names nothing):
- CuPy: every cubin NVRTC (or nvcc) produced or CuPy loaded from its kernel cache, caught by
  wrapping three functions of `cupy.cuda.compiler` (CuPy 14), when the candidate's own code asked
  for it (`requested_by_candidate`: the innermost Python frame outside CuPy is candidate.py); the
  kernels CuPy generates for its own functions (`cupy_*`, e.g. `cupy.exp`) and those a library
  built on CuPy compiles for its functions (cupyx's filters and special functions, named as the
  library chose) are library code, not the candidate's;
- load_inline and any other shared library the candidate built and loaded: the cubins embedded
  in `.so` files mapped into the process after the candidate started loading (`/proc/self/maps`),
  from the build cache or the temp folder only (torch's own libraries load lazily too).
Entry points and names are read from the machine code by `kernel_names`.
"""
from __future__ import annotations

import os
import re
import sys
import sysconfig
import tempfile

import torch

from . import records
from .harness import CANDIDATE_FILE
from .kernel_names import entry_symbols, qualified_from_mangled
from .rules import HarnessTampered, is_library_name, trusted

PACKAGES = re.compile(r"[/\\](site|dist)-packages[/\\]")   # installed libraries, even under the stdlib's folder


def gpu_records(fn) -> tuple[object, list]:
    """(fn(), records): `[name, start_ns, end_ns, correlation_id, on_gpu]` of every kernel, copy and
    memset that `fn` ran (`on_gpu` True) and of every CUDA runtime and driver call it made (False),
    as CUPTI recorded them. The session is driven through the profiler's own entry points captured
    before any candidate ran (`rules.trusted`; the candidate's worker refuses the public ones,
    `guard`), with a fixed configuration: CUDA activity, nothing else. Built from captured functions
    and list appends only, with no arithmetic, so that the records reach the parent as the GPU
    wrote them; they are judged there (`records`). A session that can no longer be ended was ended
    inside `fn`: HarnessTampered."""
    config = trusted.profiler_config(trusted.kineto, False, False, False, False, False,
                                     trusted.experimental_config(), "")
    activities = {trusted.cuda_activity}
    trusted.prepare_profiler(config, activities)
    trusted.enable_profiler(config, activities)
    try:
        result = fn()
        trusted.cuda_synchronize()
    finally:
        try:
            session = trusted.disable_profiler()
        except RuntimeError as exc:
            raise HarnessTampered(f"the profiler's session was ended while it recorded ({exc})") from None
    found = []
    for event in trusted.kineto_events(session):
        found.append([trusted.event_name(event), trusted.event_start_ns(event), trusted.event_end_ns(event),
                      trusted.event_correlation(event), trusted.event_device_type(event) == trusted.cuda_device_type])
    return result, found


def gpu_activity(fn, exclude: frozenset = frozenset(), timeline: bool = False) -> tuple[object, dict]:
    """(fn(), `records.activity` of its records); with `timeline` also "timeline": the records
    as (start_ns, end_ns, name) in start order. For trusted callers (the judge, the timer)."""
    result, found = gpu_records(fn)
    summary = records.activity(found, exclude)
    summary["excluded"] = sorted(exclude)
    if timeline:
        summary["timeline"] = sorted((start, end, name) for name, start, end in records.on_device(found))
    return result, summary


def marker_name(cache: list = []) -> str:
    """The profiler's name of the harness's marker kernel (`torch.cuda._sleep(0)`, a spin kernel)."""
    if not cache:
        cache.extend(name for name, _, _ in records.on_device(gpu_records(lambda: trusted.marker(0))[1]))
    return cache[0]


def matched_families(device: torch.device) -> list[str]:
    """The families of device work (`records.LAUNCH_FAMILIES`: kernel launches, graph launches,
    copies, memsets) whose every runtime or driver call the profiler matched with a device record
    in a probe of each, made before any candidate runs: the families `records.unrecorded_launches`
    may check (a family CUPTI reports otherwise here, or that cannot be probed, is left unchecked)."""
    found = []
    for family, probe in _probes(device).items():
        try:
            calls = gpu_records(probe)[1]
        except Exception:
            continue
        pattern = records.LAUNCH_FAMILIES[family]
        present = any(pattern.match(r[0]) for r in records.api_calls(calls))
        if present and not records.unrecorded_launches(calls, [family]):
            found.append(family)
    return found


def _probes(device: torch.device) -> dict:
    """One piece of work per launch family (`matched_families`)."""
    x, host = torch.ones(1024, device=device), torch.ones(1024)
    probes = {"kernel": lambda: x.add_(1), "copy": lambda: (x.cpu(), x.copy_(host))}
    try:
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            x.mul(2)                               # lazy initialisation outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.cuda.graph(graph):
            x.mul(2)
        probes["graph"] = graph.replay
    except Exception:
        pass
    try:   # CuPy is optional (the [gpu] extra): without it, no probe of its path
        import cupy
        stream = torch.cuda.current_stream(device).cuda_stream
        probes["set"] = lambda: cupy.cuda.runtime.memsetAsync(x.data_ptr(), 0, 16, stream)
    except ImportError:
        pass
    return probes


class CompiledKernels:
    """The qualified names of the kernels candidates compiled in this worker (module docstring).

    Names accumulate over the worker's candidates: CuPy and the build cache hand a later
    candidate with the same source the module compiled for an earlier one, without compiling
    or mapping anything again (and a candidate can only launch a kernel of a module it built
    from source). `start(roots)` at the beginning of a candidate's load; `names()` after."""

    def __init__(self):
        self._names: set[str] = set()
        self._maps_before: set[str] = _mapped_libraries()
        self._roots: tuple[str, ...] = ()
        self.hooked = _hook_cupy(self.add_binary)

    def start(self, roots: list[str]) -> None:
        self._roots = tuple(os.path.realpath(r) + os.sep for r in [*roots, tempfile.gettempdir()])

    def names(self) -> set[str]:
        for path in _mapped_libraries() - self._maps_before:
            if os.path.realpath(path).startswith(self._roots):
                try:
                    with open(path, "rb") as f:
                        self.add_binary(f.read())
                except OSError:
                    pass
                self._maps_before.add(path)
        return set(self._names)

    def add_binary(self, data) -> None:
        if isinstance(data, (bytes, bytearray)):
            for symbol in entry_symbols(bytes(data)):
                name = qualified_from_mangled(symbol)
                # CuPy's own elementwise / reduction kernels, and library kernel names, are never the candidate's
                if not name.startswith("cupy_") and not is_library_name(name):
                    self._names.add(name)


def _mapped_libraries() -> set[str]:
    try:
        with open("/proc/self/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f if ".so" in line and len(line.split(None, 5)) == 6}
    except OSError:
        return set()


def requested_by_candidate(frame, skip: tuple[str, ...], stdlib: tuple[str, ...] = ()) -> bool:
    """Whether `frame` (the caller of a CuPy compile) runs for the candidate's own code: the
    innermost frame outside the folders `skip` (CuPy's packages and this file; CuPy's Cython code
    makes no Python frames) and Python's standard library (`stdlib`, its installed packages
    excepted: a `with` or `functools` frame of CuPy's is CuPy's) is one of the candidate's module.
    A cupyx function between them, or any other library, makes the kernel that library's."""
    def passed(name: str) -> bool:
        return name.startswith(skip) or (name.startswith(stdlib) and not PACKAGES.search(name))

    while frame is not None and passed(frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename == CANDIDATE_FILE


def standard_library() -> tuple[str, ...]:
    """The folders of Python's standard library, as imported and resolved."""
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
    return tuple({p.rstrip(os.sep) + os.sep for path in paths for p in (path, os.path.realpath(path))})


def _hook_cupy(record) -> bool:
    """Wrap CuPy's compile and cache-load functions so that every cubin it loads for the
    candidate's own code (`requested_by_candidate`) is `record`ed."""
    try:   # CuPy is optional (the [gpu] extra): nothing to hook without it
        import cupy
        import cupy.cuda.compiler as compiler
        import cupy_backends
    except ImportError:
        return False
    nvrtc, nvcc, backend = (getattr(compiler, n, None) for n in
                            ("_compile_using_nvrtc_no_warning", "compile_using_nvcc", "_kernel_cache_backend"))
    if nvrtc is None or nvcc is None or backend is None or not hasattr(backend, "load"):
        return False
    load = backend.load
    # frames carry the path a module was imported by, which may run through a link
    skip = tuple({folder.rstrip(os.sep) + os.sep for m in (cupy, cupy_backends) for path in m.__path__
                  for folder in (path, os.path.realpath(path))} | {__file__, os.path.realpath(__file__)})

    stdlib = standard_library()

    def own(binary) -> None:
        if requested_by_candidate(sys._getframe(2), skip, stdlib):
            record(binary)

    def compiled_nvrtc(*args, **kwargs):
        out = nvrtc(*args, **kwargs)
        own(out[0])
        return out

    def compiled_nvcc(*args, **kwargs):
        out = nvcc(*args, **kwargs)
        own(out)
        return out

    def loaded(name):
        out = load(name)
        own(out)
        return out
    compiler._compile_using_nvrtc_no_warning, compiler.compile_using_nvcc, backend.load = (
        compiled_nvrtc, compiled_nvcc, loaded)
    return True
