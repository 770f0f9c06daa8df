"""The fast load_inline build: torch's flags, a precompiled header, two compiles, one link (DESIGN.md §8.5).

`fast_build` compiles the units of `inline.split_program` with torch's own flags, read from the
ninja file torch.utils.cpp_extension._write_ninja_file_to_build_library writes (so they follow the
installed torch): the host unit with main.cpp's g++ flags plus a precompiled header (`-include`;
built once per toolchain and flags into the cache, atomically, under a lock a killed build
releases), the device unit with torch's nvcc flags except that the architecture list is the GPU's
own `-gencode=arch=compute_XY,code=sm_XY` (no PTX copy), and both linked as torch links
(`$cxx $in $ldflags -o $out`). Compiles run in parallel, each holding one of `CompilerSlots`
(file locks shared by every process that builds into the cache).

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

import fcntl
import hashlib
import inspect
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch.utils.cpp_extension as cpp_extension

from .inline import DEVICE_PRELUDE, DISPATCH_HEADER, TORCH_PREFIX, Split, Unsplittable, split_program

DISPATCH_SOURCE = DISPATCH_HEADER.with_name("dispatch.cpp")

SHELL_SPECIAL = re.compile(r"""[$`\\"'*?;|&<>(){}\[\]~!#\s]""")
HOST_FLAGS = re.compile(r"-O[0-3s]?|-g\w*|-w|-W[\w=+-]*|-fPIC|-pipe|-std=[\w+]+")
DEVICE_FLAGS = re.compile(r"-O[0-3]|--?use_fast_math|-lineinfo|-g|-G|-w|--expt-relaxed-constexpr|--expt-extended-lambda|"
                          r"--extended-lambda|-res-usage|--resource-usage|--restrict|-std=[\w+]+|"
                          r"(-Xptxas|--ptxas-options|-maxrregcount|--maxrregcount|-arch|-gencode|--generate-code|-code|"
                          r"--gpu-architecture|--ftz|--prec-div|--prec-sqrt|--fmad|-Xcudafe|-rdc|--relocatable-device-code)"
                          r"(=\S+)?|-D\w+(=\S*)?|-U\w+")
TAKES_VALUE = {"-Xptxas", "--ptxas-options", "-maxrregcount", "--maxrregcount", "-arch", "-gencode", "--generate-code",
               "-code", "--gpu-architecture", "-Xcudafe"}
RESERVED_MACRO = re.compile(r"NDEBUG|_(?!_CUDA_NO_)\w*|(C10|TORCH|AT|CAFFE2?|PYBIND11|USE)_\w*")
PCH_REJECTED = "not used because"
RETRY_FAILED_S = 600.0   # a toolchain artifact that failed to build is tried again after this
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
QUOTED = r"['\u2018\"](\w+)['\u2019\"]"
UNDECLARED = re.compile(rf"error: (?:identifier \"(\w+)\" is undefined|{QUOTED} (?:was not declared in this scope|"
                        rf"does not name a type|has not been declared)|{QUOTED} in namespace \S+ does not name a type)")


class FastBuildFailed(Exception):
    """The split build failed where torch's build might not; build with torch's load_inline instead."""


class SharedCompileError(Exception):
    """A compiler error torch's own build hits as well (`shared_error`): the verdict, no fallback."""


class Flags:
    """torch's compiler and flags for one load_inline call (`name` = TORCH_EXTENSION_NAME)."""

    def __init__(self, arguments: dict, name: str, capability: tuple[int, int] | None):
        if cpp_extension.CUDA_HOME is None:
            raise Unsplittable("toolchain", "torch found no CUDA toolkit (CUDA_HOME)")
        user = {k: [w for f in arguments[k] or [] for w in _words(f, k)]
                for k in ("extra_cflags", "extra_cuda_cflags", "extra_ldflags")}
        ninja = _torch_ninja(arguments, name, capability)
        self.cxx, self.nvcc = shlex.split(ninja["cxx"]), shlex.split(ninja["nvcc"])
        self.name_flag = f"-DTORCH_EXTENSION_NAME={name}"   # kept apart: the PCH and macro keys omit it
        self.cflags = [f for f in shlex.split(ninja["cflags"]) if f != self.name_flag]
        self.cuda_flags = [f for f in shlex.split(ninja["cuda_cflags"]) if f != self.name_flag]
        self.ldflags = shlex.split(ninja["ldflags"])
        self.host_defines = self._host_defines(user["extra_cflags"], user["extra_cuda_cflags"])

    def _host_defines(self, cflags: list[str], cuda_flags: list[str]) -> list[str]:
        """nvcc's -D/-U flags as lines for the host unit's cuda.cu part; refuses flags under which
        one g++ run over main.cpp and cuda.cu's host code differs from torch's two compiles."""
        for flag in cflags:
            if not HOST_FLAGS.fullmatch(flag):
                raise Unsplittable("flags", f"extra_cflags {flag!r}")
        values = iter(cuda_flags)
        for flag in values:
            if flag in TAKES_VALUE:
                next(values, None)
            elif not DEVICE_FLAGS.fullmatch(flag):
                raise Unsplittable("flags", f"extra_cuda_cflags {flag!r}")
        host_std = [f for f in self.cflags if f.startswith("-std=")][-1:]
        if host_std != [f for f in self.cuda_flags if f.startswith("-std=")][-1:]:
            raise Unsplittable("flags", "extra_cflags and extra_cuda_cflags ask for different C++ standards")
        lines = []
        for flag in self.cuda_flags:
            if flag[:2] in ("-D", "-U") and flag not in self.cflags:
                macro, _, value = flag[2:].partition("=")
                if RESERVED_MACRO.fullmatch(macro) and flag in cuda_flags:
                    raise Unsplittable("flags", f"extra_cuda_cflags {flag!r} may change torch's headers")
                lines.append(f"#undef {macro}" if flag[1] == "U" else f"#define {macro} {value or 1}")
        if [f for f in self.cflags if f[:2] in ("-D", "-U") and f not in self.cuda_flags]:
            raise Unsplittable("flags", "extra_cflags defines a macro extra_cuda_cflags does not")
        return lines

    def host(self) -> list[str]:
        return [*self.cflags, self.name_flag]

    def pch(self) -> list[str]:
        """The host flags a precompiled header must be built with: the module name aside (torch's
        headers never read TORCH_EXTENSION_NAME), so one header serves every module."""
        return list(self.cflags)

    def device(self) -> list[str]:
        return [*self.cuda_flags, self.name_flag]


def _words(flag: str, what: str) -> list[str]:
    """What sh makes of one flag in torch's ninja file; flags that need more than splitting refused."""
    words = flag.strip().split()
    if any(SHELL_SPECIAL.search(w) for w in words):
        raise Unsplittable("flags", f"{what} {flag!r} needs the shell")
    return words


def _torch_ninja(arguments: dict, name: str, capability: tuple[int, int] | None) -> dict[str, str]:
    """The variables of the build.ninja torch would write for this call (cxx, nvcc, cflags, ...),
    with TORCH_CUDA_ARCH_LIST set to the GPU's own architecture unless the user set it."""
    with tempfile.TemporaryDirectory(prefix="dice-ninja-") as folder:
        arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if arch_list is None and capability is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = f"{capability[0]}.{capability[1]}"
        try:
            ldflags = _call(cpp_extension._prepare_ldflags, extra_ldflags=list(arguments["extra_ldflags"] or []),
                            with_cuda=True, with_sycl=False, verbose=False, is_standalone=False)
            _call(cpp_extension._write_ninja_file_to_build_library, path=os.path.join(folder, "build.ninja"),
                  name=name, sources=[os.path.join(folder, "main.cpp"), os.path.join(folder, "cuda.cu")],
                  extra_cflags=list(arguments["extra_cflags"] or []),
                  extra_cuda_cflags=list(arguments["extra_cuda_cflags"] or []), extra_sycl_cflags=[],
                  extra_ldflags=ldflags, extra_include_paths=list(arguments["extra_include_paths"] or []),
                  with_cuda=True, with_sycl=False, is_standalone=False)
        except (TypeError, ValueError, OSError, RuntimeError, IndexError) as exc:
            raise Unsplittable("toolchain", f"torch's build flags: {exc}") from None
        finally:
            if arch_list is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        text = Path(folder, "build.ninja").read_text()
    return dict(re.findall(r"^(\w+) = (.*)$", text, re.MULTILINE))


def _call(function, **kwargs):
    """Call one of torch's private helpers with the arguments its signature (this torch) names."""
    parameters = inspect.signature(function).parameters
    return function(**{k: v for k, v in kwargs.items() if k in parameters})


@lru_cache(maxsize=None)
def compiler_version(argv: tuple[str, ...]) -> str:
    """`--version` of a compiler, part of every cache key (so a new compiler rebuilds)."""
    try:
        return subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"


class CompilerSlots:
    """At most `count` compilers at once over every process building into `root`: one flock'ed
    file per slot, released by the kernel when its holder dies."""

    def __init__(self, root: Path, count: int | None = None):
        self.folder = root / "slots"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.count = count or os.cpu_count() or 1

    @contextmanager
    def hold(self):
        order = list(range(self.count))
        while True:
            random.shuffle(order)
            for i in order:
                fd = os.open(self.folder / f"slot-{i}", os.O_CREAT | os.O_RDWR, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                try:
                    yield
                finally:
                    os.close(fd)
                return
            time.sleep(0.05)


def run_compiler(argv: list[str], log: Path, slots: CompilerSlots) -> tuple[int, float]:
    """(exit status, CPU seconds of the compiler and its children); output into `log`."""
    with slots.hold(), open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, usage.ru_utime + usage.ru_stime


BUILD_FOLDER = "<build>"   # the build folder's path in a kept unit's key and compiler output


class CompiledUnits:
    """Objects of compiled units shared by every build under `root`: a unit whose text and command,
    the build folder's own path left out of both, were compiled before is copied, not compiled
    again. The programs of an RL group often differ in one unit only (infilled kernels under the
    same host code, or the same host code around new kernels); each builds in its own folder, which
    the units' `#line` directives name. Only objects of successful compiles are kept, each with its
    compiler output (the folder's path in it replaced by the copying build's); a failure is compiled
    again, so its message is the program's. A copied object's `__FILE__` names the folder that
    compiled it: a path in a message, never a verdict."""

    def __init__(self, root: Path, build_dir: Path):
        self.folder, self.build_dir = root / "objects", build_dir

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
        if kept.is_file() and kept.with_suffix(".log").is_file():
            log.write_text(kept.with_suffix(".log").read_text(errors="replace").replace(BUILD_FOLDER, folder))
            shutil.copyfile(kept, target)
            return 0, 0.0
        status, cpu_s = run_compiler(argv, log, slots)
        if status == 0:
            kept.parent.mkdir(parents=True, exist_ok=True)
            output = log.read_text(errors="replace").replace(folder, BUILD_FOLDER)
            for write, name in ((lambda tmp: tmp.write_text(output), kept.with_suffix(".log")),
                                (lambda tmp: shutil.copyfile(target, tmp), kept)):   # the object last: it marks both
                tmp = name.with_name(f"{name.name}.{os.getpid()}.{random.getrandbits(32):08x}.tmp")
                write(tmp)
                os.replace(tmp, name)
        return status, cpu_s


def _locked_artifact(root: Path, key: str, make) -> Path | None:
    """root/key, made once by make(tmp_folder) -> bool under root/key.lock and renamed into place;
    None if making it failed. A failure is remembered for RETRY_FAILED_S, not for good: one that
    came from its moment (a compiler killed with its build, a process without stdin: nvcc cannot
    preprocess then) must not leave a cache without the fast build for ever."""
    final = root / key
    if not (final / "ok").exists() and not _failed_recently(final):
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (final / "ok").exists() and not _failed_recently(final):
                tmp = Path(tempfile.mkdtemp(prefix=f"tmp-{key[:8]}-", dir=root))
                try:
                    if make(tmp):
                        (tmp / "ok").touch()
                    shutil.rmtree(final, ignore_errors=True)
                    os.replace(tmp, final)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return final if (final / "ok").exists() else None


def _failed_recently(final: Path) -> bool:
    try:
        return time.time() - final.stat().st_mtime < RETRY_FAILED_S
    except FileNotFoundError:
        return False


def precompiled_header(root: Path, flags: Flags, slots: CompilerSlots, binding: str = "pybind") -> Path | None:
    """The prefix header whose .gch matches these host flags: torch/extension.h for torch's
    binding, dispatch.h (torch/types.h and the entry templates) for the generic one."""
    text = "#include <torch/extension.h>\n" if binding == "pybind" else f'#include "{DISPATCH_HEADER}"\n'
    key = hashlib.sha256(json.dumps([flags.cxx, flags.pch(), compiler_version(tuple(flags.cxx)), text,
                                     _source_hash(DISPATCH_HEADER) if binding == "dispatch" else ""]).encode()).hexdigest()

    def make(folder: Path) -> bool:
        (folder / "prefix.h").write_text(text)
        status, _ = run_compiler([*flags.cxx, "-x", "c++-header", *flags.pch(), str(folder / "prefix.h"), "-o",
                                  str(folder / "prefix.h.gch")], folder / "log", slots)
        return status == 0

    folder = _locked_artifact(root / "pch", key[:32], make)
    return folder / "prefix.h" if folder else None


def dispatcher(root: Path, flags: Flags, slots: CompilerSlots) -> Path | None:
    """dispatch.cpp built once per toolchain and torch's own flags into the Python extension
    `dice_dispatch` (the flags of a program's extra_cflags may only tune codegen, so one serves all)."""
    key = hashlib.sha256(json.dumps([flags.cxx, flags.pch(), flags.ldflags, compiler_version(tuple(flags.cxx)),
                                     _source_hash(DISPATCH_SOURCE), _source_hash(DISPATCH_HEADER)]).encode()).hexdigest()

    def make(folder: Path) -> bool:
        status, _ = run_compiler([*flags.cxx, *flags.pch(), "-DTORCH_EXTENSION_NAME=dice_dispatch", str(DISPATCH_SOURCE),
                                  *flags.ldflags, "-ldl", "-o", str(folder / "dice_dispatch.so")], folder / "log", slots)
        return status == 0

    folder = _locked_artifact(root / "dispatch", key[:32], make)
    return folder / "dice_dispatch.so" if folder else None


def _source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def torch_macros(root: Path, flags: Flags) -> frozenset[str]:
    """Macros torch's headers define under nvcc that DEVICE_PRELUDE's headers do not: device code
    that names one would compile differently without torch's headers."""
    nvcc = [f for f in flags.cuda_flags if not f.startswith("-gencode")]
    key = hashlib.sha256(json.dumps([flags.nvcc, nvcc, compiler_version(tuple(flags.nvcc))]).encode()).hexdigest()

    def make(folder: Path) -> bool:
        names = []
        for unit, lines in (("torch", [*TORCH_PREFIX, "#include <torch/extension.h>"]),
                            ("prelude", [*(f"#include <{h}>" for h in DEVICE_PRELUDE), *TORCH_PREFIX[1:]])):
            (folder / f"{unit}.cu").write_text("\n".join(lines) + "\n")
            done = subprocess.run([*flags.nvcc, *nvcc, "-E", "-Xcompiler", "-dM", str(folder / f"{unit}.cu")],
                                  capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                return False
            names.append(set(re.findall(r"^#define (\w+)", done.stdout, re.MULTILINE)))
        (folder / "macros.json").write_text(json.dumps(sorted(names[0] - names[1])))
        return True

    folder = _locked_artifact(root / "macros", key[:32], make)
    if folder is None:
        raise Unsplittable("toolchain", "nvcc could not preprocess torch's headers")
    return frozenset(json.loads((folder / "macros.json").read_text()))


def header_names(root: Path, flags: Flags) -> frozenset[str] | None:
    """Every identifier and macro name in what torch's build compiles before a program's own
    lines: main.cpp's torch/extension.h under g++, and cuda.cu's prefix plus torch/extension.h
    (which cuda_sources include) under nvcc. A name outside this set and not declared by the
    program is undeclared in torch's build too. None if the preprocessors failed."""
    nvcc = [f for f in flags.cuda_flags if not f.startswith("-gencode")]
    key = hashlib.sha256(json.dumps([flags.cxx, flags.pch(), flags.nvcc, nvcc, compiler_version(tuple(flags.cxx)),
                                     compiler_version(tuple(flags.nvcc))]).encode()).hexdigest()

    def make(folder: Path) -> bool:
        (folder / "main.cpp").write_text("#include <torch/extension.h>\n")
        (folder / "cuda.cu").write_text("\n".join([*TORCH_PREFIX, "#include <torch/extension.h>"]) + "\n")
        names = set()
        for argv in ([*flags.cxx, *flags.pch(), "-E", str(folder / "main.cpp")],
                     [*flags.cxx, *flags.pch(), "-E", "-dM", str(folder / "main.cpp")],
                     [*flags.nvcc, *nvcc, "-E", str(folder / "cuda.cu")],
                     [*flags.nvcc, *nvcc, "-E", "-Xcompiler", "-dM", str(folder / "cuda.cu")]):
            done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                return False
            names.update(IDENTIFIER.findall(done.stdout))
        (folder / "names.json").write_text(json.dumps(sorted(names)))
        return True

    folder = _locked_artifact(root / "names", key[:32], make)
    return frozenset(json.loads((folder / "names.json").read_text())) if folder else None


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


def fast_build(arguments: dict, name: str, build_dir: Path, root: Path, capability: tuple[int, int] | None,
               slots: CompilerSlots, *, flags: Flags | None = None, binding: str | None = None) -> tuple[Path, dict]:
    """Build `name`.so in build_dir the split way; (library, report), the report's "dispatcher"
    naming the dice_dispatch module that loads a library with the generic binding (else None).
    `flags`: torch's (default: `Flags` of the call); `binding`: "pybind" forces torch's binding,
    otherwise the generic one wherever it applies. Raises Unsplittable before compiling,
    SharedCompileError or FastBuildFailed after."""
    if not arguments["cuda_sources"] or arguments["with_cuda"] is False or arguments.get("sycl_sources") \
            or arguments.get("no_implicit_headers") or arguments.get("use_pch") or capability is None:
        raise Unsplittable("arguments", "not a plain CUDA load_inline call")
    flags = flags or Flags(arguments, name, capability)
    sources = [arguments[k] if not isinstance(arguments[k], str) else [arguments[k]]
               for k in ("cpp_sources", "cuda_sources")]

    def make_split(way: str) -> Split:
        return split_program(*sources, arguments["functions"], arguments.get("with_pytorch_error_handling", True),
                             str(build_dir / "cuda.cu"), torch_macros(root, flags), tuple(flags.host_defines), way)

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
        library, report = _compile_and_link(split, flags, build_dir, pch, slots, CompiledUnits(root, build_dir))
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
        device_run = pool.submit(objects.compile, device, flags.nvcc, build_dir / "device.log", slots)
        (host_status, host_s), (device_status, device_s) = host_run.result(), device_run.result()
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
