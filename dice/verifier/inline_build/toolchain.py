"""What the fast load_inline build (`fast`) needs from the toolchain: torch's own flags for a call
(`Flags`, read from the ninja file torch writes), the compilers run under `CompilerSlots` (file
locks shared by every process that builds into the cache), and the artifacts built once per
toolchain and flags into the cache, each atomically under a lock a killed build releases
(`_locked_artifact`): the precompiled header, the `dice_dispatch` extension, the macros torch's
headers define and every name they declare, the names `inline.LAZY_HEADERS` add to the device
unit (DESIGN.md §8.5)."""

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
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch.utils.cpp_extension as cpp_extension

from .inline import DEVICE_PRELUDE, DISPATCH_HEADER, LAZY_HEADERS, Unsplittable
from .torch_inline import TORCH_PREFIX

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
RETRY_FAILED_S = 600.0   # a toolchain artifact that failed to build is tried again after this
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
ARTIFACTS = ("pch", "dispatch", "macros", "lazy", "names")   # the folders `_locked_artifact` fills
# {path under the cache root: sha256} of the toolchain's artifacts as a trusted process built them
# (`BuildPool.warm`'s child, which runs no candidate code), or None in that process itself: where
# set (a prebuild of a candidate, a candidate's worker), an artifact is used only if its files are
# these bytes, so one a candidate planted or changed in the shared cache is never read (DESIGN.md §8.4)
TRUSTED: dict[str, str] | None = None


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


def _locked_artifact(root: Path, key: str, make) -> Path | None:
    """root/key, made once by make(tmp_folder) -> bool under root/key.lock and renamed into place;
    None if making it failed. A failure is remembered for RETRY_FAILED_S, not for good: one that
    came from its moment (a compiler killed with its build, a process without stdin: nvcc cannot
    preprocess then) must not leave a cache without the fast build for ever."""
    final = root / key
    if TRUSTED is not None:      # a process that may run candidate code makes none and checks what it reads
        return final if trusted_artifact(final) else None
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


def artifact_digests(root: Path) -> dict[str, str]:
    """{path under `root`: sha256} of every file of the toolchain's artifacts built there."""
    return {str(f.relative_to(root)): file_digest(f) for folder in ARTIFACTS for f in sorted((root / folder).rglob("*"))
            if f.is_file() and not f.name.endswith(".lock") and f.parent != root / folder}


def trusted_artifact(folder: Path) -> bool:
    """Whether `folder` (an artifact's, under a cache root) holds exactly the files TRUSTED lists
    for it, with their digests."""
    root, prefix = folder.parents[1], f"{folder.parent.name}/{folder.name}/"
    wanted = {path: digest for path, digest in TRUSTED.items() if path.startswith(prefix)}
    if f"{prefix}ok" not in wanted:
        return False
    return all(file_digest(root / path) == digest for path, digest in wanted.items())


def file_digest(path: Path) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


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


def lazy_names(root: Path, flags: Flags) -> frozenset[str] | None:
    """What `LAZY_HEADERS` add to DEVICE_PRELUDE's other headers under torch's nvcc flags: every
    macro they define and every name they declare at namespace scope (types, functions, their
    overloads' names, enumerators; `namespace_scope_names`), less those the other headers define
    or declare there already. A device unit naming none of them compiles without those headers to
    the same program (`inline.split_program`). None if nvcc could not preprocess them (every unit
    keeps them)."""
    nvcc = [f for f in flags.cuda_flags if not f.startswith("-gencode")]
    key = hashlib.sha256(json.dumps([flags.nvcc, nvcc, compiler_version(tuple(flags.nvcc)), LAZY_HEADERS]).encode()
                         ).hexdigest()

    def make(folder: Path) -> bool:
        found = {}
        for unit, headers in (("full", DEVICE_PRELUDE), ("lean", [h for h in DEVICE_PRELUDE if h not in LAZY_HEADERS])):
            (folder / f"{unit}.cu").write_text("\n".join([*(f"#include <{h}>" for h in headers), *TORCH_PREFIX[1:]]) + "\n")
            outputs = []
            for extra in ([], ["-Xcompiler", "-dM"]):
                done = subprocess.run([*flags.nvcc, *nvcc, "-E", *extra, str(folder / f"{unit}.cu")],
                                      capture_output=True, text=True, stdin=subprocess.DEVNULL)
                if done.returncode != 0:
                    return False
                outputs.append(done.stdout)
            code, macros = outputs
            found[unit] = namespace_scope_names(code) | set(re.findall(r"^#define (\w+)", macros, re.MULTILINE))
        (folder / "names.json").write_text(json.dumps(sorted(found["full"] - found["lean"])))
        return True

    folder = _locked_artifact(root / "lazy", key[:32], make)
    return frozenset(json.loads((folder / "names.json").read_text())) if folder else None


def namespace_scope_names(code: str) -> set[str]:
    """Identifiers of preprocessed C++ outside every function body, class body and parenthesis:
    the names a declaration at namespace scope introduces (with its keywords and types), never a
    parameter or a local. Namespace, `extern "C"` and enum braces do not count as bodies."""
    names, stack, depth, recent = set(), [], 0, []
    for token in re.findall(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|^#[^\n]*|[A-Za-z_]\w*|[{}();]',
                            code, re.MULTILINE):
        if token == "{":
            words = [t for t in recent if t[:1] not in "\"'"]
            stack.append("namespace" in words or "enum" in words or words[-1:] == ["extern"])
            recent = []
        elif token == "}":
            if stack:
                stack.pop()
            recent = []
        elif token in ("(", ")", ";"):
            depth += {"(": 1, ")": -1, ";": 0}[token]
            recent = [] if token == ";" else recent
        elif token[0] != "#":
            recent.append(token)
            if depth == 0 and all(stack) and token[0] not in "\"'":
                names.add(token)
    return names


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
