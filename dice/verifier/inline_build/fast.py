"""The fast load_inline build: torch's flags, a precompiled header, two compiles, one link (DESIGN.md §8.5).

`fast_build` compiles the units of `inline.split_program` with torch's own flags, read from the
ninja file torch.utils.cpp_extension._write_ninja_file_to_build_library writes (so they follow the
installed torch; `toolchain.Flags`): the host unit with main.cpp's g++ flags plus a precompiled
header (`-include`; built once per toolchain and flags into the cache, `toolchain`), the device unit
with torch's nvcc flags except that the architecture list is the GPU's own
`-gencode=arch=compute_XY,code=sm_XY` (no PTX copy), and both linked as torch links (`$cxx $in
$ldflags -o $out`). Compiles run in parallel, each holding one of `CompilerSlots` (file locks shared
by every process that builds into the cache). A device unit that names nothing of what
<algorithm>, cuda_fp16.h and cuda_bf16.h declare compiles without them (a third of its nvcc
time), and again with them if that fails (`inline.split_program`).

Bindings. A Python-module call with `functions` gets the generic binding: the host unit on a
precompiled dispatch.h (torch/types.h and the entry templates) and the `dice_dispatch` extension
(dispatch.cpp, built once per toolchain and flags, `dispatcher`) that loads it. Otherwise torch's
PYBIND11_MODULE binding on a precompiled torch/extension.h, whose deferred template instantiation
costs several CPU seconds in every unit.

Failures are not verdicts unless torch's build must fail the same way (`shared_error`): an error
in the host unit's first lines when they are torch's main.cpp verbatim, or a name used but
declared nowhere: neither by the program nor in any header torch's build sees (`header_names`:
every identifier and macro of torch/extension.h under g++ and of torch's cuda.cu prefix with
torch/extension.h under nvcc, implicit CUDA headers included). Those raise `SharedCompileError`;
any other failure raises `FastBuildFailed` and the caller builds with torch's load_inline instead."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .inline import Split, Unsplittable, split_program
from .toolchain import (CompilerSlots, Flags, compiler_version, dispatcher, header_names, lazy_names,
                        precompiled_header, run_compiler, torch_macros)

PCH_REJECTED = "not used because"
# longest wait for a unit a sibling is compiling (seconds of a contended host unit's compile, with
# room); a lock held longer, as a candidate's process could hold one, is passed by: compiled anew
UNIT_LOCK_WAIT_S = 120.0
QUOTED = r"['\u2018\"](\w+)['\u2019\"]"
UNDECLARED = re.compile(rf"error: (?:identifier \"(\w+)\" is undefined|{QUOTED} (?:was not declared in this scope|"
                        rf"does not name a type|has not been declared)|{QUOTED} in namespace \S+ does not name a type)")


class FastBuildFailed(Exception):
    """The split build failed where torch's build might not; build with torch's load_inline instead."""


class SharedCompileError(Exception):
    """A compiler error torch's own build hits as well (`shared_error`): the verdict, no fallback."""


BUILD_FOLDER = "<build>"   # the build folder's path in a kept unit's key and compiler output


class CompiledUnits:
    """Objects of compiled units shared by every build under `root`: a unit whose text and command,
    the build folder's own path left out of both, were compiled before is copied, not compiled
    again. The programs of an RL group often differ in one unit only (infilled kernels under the
    same host code, or the same host code around new kernels); each builds in its own folder, which
    the units' `#line` directives name. Only objects of successful compiles are kept, each with its
    compiler output (the folder's path in it replaced by the copying build's); a failure is compiled
    again, so its message is the program's. A copied object's `__FILE__` names the folder that
    compiled it: a path in a message, never a verdict.

    `seal`: a key only builders that run no candidate code hold (`pool.serve`, DESIGN.md §8.4).
    Each kept unit then also has `<key>.mac`, an HMAC-SHA256 of its key, object and output under
    `seal`, written last; a unit is copied only when the bytes read match it, so a unit planted or
    changed by a candidate's process is compiled again, never used."""

    def __init__(self, root: Path, build_dir: Path, seal: bytes | None = None):
        self.folder, self.build_dir, self.seal = root / "objects", build_dir, seal

    def compile(self, argv: list[str], compiler: list[str], log: Path, slots: CompilerSlots) -> tuple[int, float]:
        """run_compiler's (exit status, CPU seconds) for `argv` (`-c SOURCE -o OBJECT` at its end); a
        copy costs no compiler seconds."""
        source, target = Path(argv[argv.index("-c") + 1]), Path(argv[argv.index("-o") + 1])
        folder = str(self.build_dir)
        text = source.read_text().replace(folder, BUILD_FOLDER)
        # the module's name (a hash of the whole program) matters only to a unit that names it:
        # torch's headers never read TORCH_EXTENSION_NAME, torch's main.cpp binding does
        command = [a.replace(folder, BUILD_FOLDER) for a in argv
                   if not a.startswith("-DTORCH_EXTENSION_NAME=") or "TORCH_EXTENSION_NAME" in text]
        key = hashlib.sha256(json.dumps([command, compiler_version(tuple(compiler)), text]).encode()).hexdigest()
        kept = self.folder / key[:2] / f"{key}.o"
        kept.parent.mkdir(parents=True, exist_ok=True)
        # an RL group's 16 programs build at once: one compiles a shared unit, the others wait for its
        # object (holding no compiler slot) instead of compiling it 16 times; a failed unit, never kept,
        # is then compiled by each in turn; a killed holder's lock goes with it
        with open(kept.with_suffix(".lock"), "w") as lock:
            if not _locked_within(lock, UNIT_LOCK_WAIT_S):   # a candidate's process may hold it: keep nothing
                return run_compiler(argv, log, slots)
            found = self._read_kept(kept, key)
            if found is not None:
                obj, output = found
                log.write_text(output.decode(errors="replace").replace(BUILD_FOLDER, folder))
                target.write_bytes(obj)   # the bytes checked, not the file again
                return 0, 0.0
            status, cpu_s = run_compiler(argv, log, slots)
            if status == 0:
                output = log.read_text(errors="replace").replace(folder, BUILD_FOLDER).encode()
                obj = target.read_bytes()
                files = [(kept.with_suffix(".log"), output), (kept, obj)]
                if self.seal is not None:
                    files.append((kept.with_suffix(".mac"), self._mac(key, obj, output)))
                for name, data in files:   # the last written marks all: the object, or its seal
                    tmp = name.with_name(f"{name.name}.{os.getpid()}.{random.getrandbits(32):08x}.tmp")
                    tmp.write_bytes(data)
                    os.replace(tmp, name)
        return status, cpu_s

    def _read_kept(self, kept: Path, key: str) -> tuple[bytes, bytes] | None:
        """(object, compiler output) of a kept unit, or None where there is none (or, sealed, none
        whose bytes match their seal)."""
        try:
            obj, output = kept.read_bytes(), kept.with_suffix(".log").read_bytes()
            mac = kept.with_suffix(".mac").read_bytes() if self.seal is not None else None
        except OSError:
            return None
        if self.seal is not None and not hmac.compare_digest(mac, self._mac(key, obj, output)):
            return None
        return obj, output

    def _mac(self, key: str, obj: bytes, output: bytes) -> bytes:
        message = b"\0".join([key.encode(), hashlib.sha256(obj).digest(), hashlib.sha256(output).digest()])
        return hmac.new(self.seal, message, hashlib.sha256).digest()


def _locked_within(lock, seconds: float) -> bool:
    """Take `lock`'s exclusive flock, waiting at most `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def shared_error(log: str, names: frozenset[str], declared: frozenset[str]) -> str | None:
    """The first error line of `log` that names an identifier as undeclared (g++: "was not declared
    in this scope", "does not name a type", "has not been declared"; nvcc: "is undefined") where
    that identifier is neither in torch's headers (`names`) nor declared by the program."""
    for line in log.splitlines():
        found = UNDECLARED.search(line)
        name = found and next(g for g in found.groups() if g)
        if name and name not in names and name not in declared and not name.startswith("__dice"):
            return line.strip()
    return None


def warm_toolchain(root: Path, capability: tuple[int, int], slots: CompilerSlots) -> None:
    """Build now what the first fast build of a call without extra flags would wait for: both
    bindings' precompiled headers (the generic one ~30 CPU-s), the dispatcher, torch's macros and
    header names, and the lazy headers' names (`toolchain`). A failure here is the first build's to
    report again."""
    flags = Flags(dict.fromkeys(["extra_cflags", "extra_cuda_cflags", "extra_ldflags", "extra_include_paths"]),
                  "dice_warm", capability)
    makers = [lambda: precompiled_header(root, flags, slots, "dispatch"), lambda: dispatcher(root, flags, slots),
              lambda: torch_macros(root, flags), lambda: lazy_names(root, flags), lambda: header_names(root, flags),
              lambda: precompiled_header(root, flags, slots, "pybind")]
    with ThreadPoolExecutor(len(makers)) as pool:
        for done in [pool.submit(make) for make in makers]:
            with contextlib.suppress(Unsplittable):   # torch_macros: nvcc could not preprocess
                done.result()


def fast_build(arguments: dict, name: str, build_dir: Path, root: Path, capability: tuple[int, int] | None,
               slots: CompilerSlots, *, flags: Flags | None = None, binding: str | None = None,
               units: Path | None = None, seal: bytes | None = None) -> tuple[Path, dict]:
    """Build `name`.so in build_dir the split way; (library, report), the report's "dispatcher"
    naming the dice_dispatch module that loads a library with the generic binding (else None).
    `flags`: torch's (default: `Flags` of the call); `binding`: "pybind" forces torch's binding,
    otherwise the generic one wherever it applies; `units`: where compiled units are kept (default
    `root`, where the toolchain's artifacts are), under `seal` if given (`CompiledUnits`). Raises
    Unsplittable before compiling, SharedCompileError or FastBuildFailed after."""
    if not arguments["cuda_sources"] or arguments["with_cuda"] is False or arguments.get("sycl_sources") \
            or arguments.get("no_implicit_headers") or arguments.get("use_pch") or capability is None:
        raise Unsplittable("arguments", "not a plain CUDA load_inline call")
    flags = flags or Flags(arguments, name, capability)
    sources = [arguments[k] if not isinstance(arguments[k], str) else [arguments[k]]
               for k in ("cpp_sources", "cuda_sources")]

    def make_split(way: str) -> Split:
        return split_program(*sources, arguments["functions"], arguments.get("with_pytorch_error_handling", True),
                             str(build_dir / "cuda.cu"), torch_macros(root, flags), tuple(flags.host_defines), way,
                             lazy_names(root, flags))

    generic = None
    if binding != "pybind" and arguments["is_python_module"] and arguments["functions"]:
        try:
            split, generic = make_split("dispatch"), dispatcher(root, flags, slots)
        except Unsplittable:   # torch's binding instead: it may still split, or fail as torch's main.cpp would
            pass
    if generic is None:
        split = make_split("pybind")
    pch = precompiled_header(root, flags, slots, split.binding)
    try:
        objects = CompiledUnits(units or root, build_dir, seal)
        library, report = _compile_and_link(split, flags, build_dir, pch, slots, objects)
    except FastBuildFailed as exc:   # the headers' names are read only when a build fails
        names = header_names(root, flags)
        if names is not None and shared_error(str(exc), names, split.declared):
            raise SharedCompileError(str(exc)) from None
        raise
    return library, {**report, "binding": split.binding, "dispatcher": str(generic) if generic else None}


def _compile_and_link(split: Split, flags: Flags, build_dir: Path, pch: Path | None,
                      slots: CompilerSlots, objects: CompiledUnits) -> tuple[Path, dict]:
    (build_dir / "main.cpp").write_text(split.host)
    (build_dir / "cuda.cu").write_text(split.device)
    host = [*flags.cxx, *flags.host(), *(["-include", str(pch), "-Winvalid-pch"] if pch else []),
            "-c", str(build_dir / "main.cpp"), "-o", str(build_dir / "main.o")]
    device = [*flags.nvcc, *flags.device(), "-c", str(build_dir / "cuda.cu"), "-o", str(build_dir / "cuda.cuda.o")]
    start = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        host_run = pool.submit(objects.compile, host, flags.cxx, build_dir / "host.log", slots)
        device_status, device_s = objects.compile(device, flags.nvcc, build_dir / "device.log", slots)
        lean = bool(split.device_full)
        if device_status != 0 and lean:   # the lean unit failed: the error (or success) is the full unit's
            lean = False
            (build_dir / "cuda.cu").write_text(split.device_full)
            device_status, full_s = objects.compile(device, flags.nvcc, build_dir / "device.log", slots)
            device_s += full_s
        host_status, host_s = host_run.result()
    host_log = (build_dir / "host.log").read_text(errors="replace")
    if host_status != 0 and _main_cpp_error(host_log, build_dir / "main.cpp", split.main_lines):
        raise SharedCompileError(host_log)
    if host_status != 0 or device_status != 0:
        raise FastBuildFailed((host_log if host_status else "") + (build_dir / "device.log").read_text(errors="replace"))
    library = build_dir / f"{flags.name_flag.split('=', 1)[1]}.so"
    link_status, link_s = run_compiler([*flags.cxx, str(build_dir / "main.o"), str(build_dir / "cuda.cuda.o"),
                                        *flags.ldflags, "-o", str(library)], build_dir / "link.log", slots)
    if link_status != 0:
        raise FastBuildFailed((build_dir / "link.log").read_text(errors="replace"))
    return library, {"host_cpu_s": host_s, "device_cpu_s": device_s, "link_cpu_s": link_s,
                     "lean_device": lean,
                     "wall_s": time.perf_counter() - start, "pch": pch is not None and PCH_REJECTED not in host_log,
                     "kernels": split.kernels}


def _main_cpp_error(log: str, main_cpp: Path, main_lines: int) -> bool:
    """Whether g++'s first error lies in (or in a header included from) main.cpp's torch lines."""
    outer = None
    for line in log.splitlines():
        included = re.match(r"\s*(?:In file included )?from (.+?):(\d+)[:,]", line)
        if included:
            outer = included
            continue
        error = re.match(r"(.+?):(\d+):(?:\d+:)? (?:fatal )?error:", line)
        if error:
            where = outer or error
            return where.group(1) == str(main_cpp) and int(where.group(2)) <= main_lines
        if not line.startswith(" "):
            outer = None
    return False
