"""Compiling candidates: a load_inline build cache and compiler messages a person can act on (DESIGN.md §8).

Runs inside candidate workers (and `pool.BuildPool`'s children). `BuildCache.install()`
replaces `torch.utils.cpp_extension.load_inline` so that candidate code building an extension goes
through the cache; CuPy (NVRTC) keeps its own kernel cache and only needs its errors worded here.

Two ways to build (`build=`, default the environment's DICE_INLINE_BUILD, else "fast"): "torch"
is torch's own load_inline; "fast" first tries `fast.fast_build` (the program split into a
device unit without torch's headers and one host unit on a precompiled header, with the generic
binding of dispatch.h/dispatch.cpp where it applies; DESIGN.md §8.5) and falls back to torch's
load_inline whenever the split is refused or its build fails, so the verdict is always the one
torch's build gives (a compile error torch's build must hit as well, `fast.shared_error`,
is reported without the fallback: an error in torch's main.cpp lines, a name declared nowhere).
A generic-binding library is cached as `<name>.dispatch.so` beside a `.dispatcher` file naming
the dice_dispatch module. A build that fails on a compiler error (an error line at a place in a
file, and no sign of a killed compiler or a full disk) is cached too, as `<name>.failed`
holding the message: every process of the cache (a prebuild, each worker) reports that
compile_error without compiling the program again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.utils.cpp_extension

from . import toolchain
from .cxx import normalise
from .fast import CompilerSlots, FastBuildFailed, SharedCompileError, fast_build, warm_toolchain
from .inline import Unsplittable
from .pinned import digest, load_sealed, pinned_bytes

BUILDS = ("fast", "torch")
STALE_BUILD_S = 3600.0  # build-* folders older than this were left by killed builds
MAX_MESSAGE_LINES = 25
LOCATED_ERROR = re.compile(r"^\S.*?(?::\d+(?::\d+)?: (?:fatal )?error\b|\(\d+\): (?:catastrophic )?error\b)", re.MULTILINE)
TRANSIENT = re.compile(r"No space left on device|Killed signal|virtual memory exhausted|Cannot allocate memory")


TORCH_LOAD_INLINE = torch.utils.cpp_extension.load_inline   # torch's own, before any cache installs itself


class BuildError(Exception):
    """A load_inline build failed; the message holds the compiler's error lines."""


class BuildCache:
    """`torch.utils.cpp_extension.load_inline` with a cache keyed by sources + flags + toolchain.

    Each build runs in its own fresh `build-*` folder (torch's FileBaton lock lives there, so a
    killed build never blocks a later one) under a unique module name `dice_ext_<hash>`; the .so
    is then moved into the cache with an atomic rename. Sources equal up to comments and
    whitespace (`cxx.normalise`) reuse it. `capability` (the GPU's, from `device` if not given)
    picks the fast build's one architecture; `history` records how each build went."""

    def __init__(self, root: Path, device: torch.device | None = None, *, capability: tuple[int, int] | None = None,
                 build: str | None = None, programs: Path | None = None, units: Path | None = None,
                 seal: bytes | None = None, pins: dict[str, dict] | None = None, on_library=None):
        self.build = build or os.environ.get("DICE_INLINE_BUILD") or "fast"
        if self.build not in BUILDS:
            raise ValueError(f"build={self.build!r}: choose one of {', '.join(BUILDS)}")
        if capability is None and device is not None and device.type == "cuda":
            capability = tuple(torch.cuda.get_device_capability(device))
        self.root, self.capability, self.programs = root, capability, programs or root
        self.units, self.seal = units or self.programs, seal   # where compiled units are kept (`fast.CompiledUnits`)
        # a candidate's own folder, which other candidates can write into: only what `pins` records is
        # used from it, and what this cache builds there is recorded in `made` (`pinned`, DESIGN.md §8.4)
        self.pins, self.made, self.on_library = pins, {}, on_library
        root.mkdir(parents=True, exist_ok=True)
        self.programs.mkdir(parents=True, exist_ok=True)
        now = time.time()
        for stale in self.programs.glob("build-*"):
            try:
                if now - stale.stat().st_mtime > STALE_BUILD_S:
                    shutil.rmtree(stale, ignore_errors=True)
            except FileNotFoundError:  # another worker removed it first
                pass
        self.toolchain = [torch.__version__, torch.version.cuda, sys.version.split()[0],
                          list(capability) if capability else None, os.environ.get("TORCH_CUDA_ARCH_LIST")]
        self.loaded: dict[str, types.ModuleType] = {}
        self.failed: dict[str, str] = {}  # torch will not rebuild a name it saw before in this process
        self.history: list[dict] = []
        self.slots = CompilerSlots(root)
        self.real_load_inline = TORCH_LOAD_INLINE

    def install(self) -> None:
        """Make `from torch.utils.cpp_extension import load_inline` in candidate code hit the cache."""
        torch.utils.cpp_extension.load_inline = self.load_inline

    def warm(self) -> None:
        """With the fast build, its toolchain artifacts built now (`fast.warm_toolchain`)."""
        if self.build == "fast" and self.capability is not None:
            warm_toolchain(self.root, self.capability, self.slots)

    def load_inline(self, *args, **kwargs):
        arguments = self.arguments(*args, **kwargs)
        name = self.name(arguments)
        if name in self.failed:
            raise BuildError(self.failed[name])
        if name not in self.loaded and self.pins is not None:
            self.loaded[name] = self._load_pinned(name, arguments)
        if name not in self.loaded:
            library, generic = self.programs / f"{name}.so", self.programs / f"{name}.dispatch.so"
            failed = self.programs / f"{name}.failed"
            # one build of a name at a time over every process of this cache (a prebuild and a worker
            # asking for the same program): the second waits and loads what the first built
            with self._name_lock(name):
                if generic.exists():
                    try:
                        self.loaded[name] = load_dispatched(name, generic, Path(f"{generic}.dispatcher").read_text())
                    except UntrustedArtifact:   # a dispatcher someone changed: torch's own build decides
                        self.build = "torch"
                        self.loaded[name] = self._build(name, arguments, library)
                    except Exception:
                        self.loaded[name] = self._rebuild(name, arguments, generic)
                elif library.exists():
                    try:
                        self.loaded[name] = _load_library(name, library, arguments["is_python_module"])
                    except Exception:
                        self.loaded[name] = self._rebuild(name, arguments, library)
                elif failed.exists():   # a compiler error another process of this cache hit
                    self.failed[name] = failed.read_text()
                    raise BuildError(self.failed[name])
                else:
                    self.loaded[name] = self._build(name, arguments, library)
        return self.loaded[name]

    def _load_pinned(self, name: str, arguments: dict):
        """In a candidate's own folder (`pins` given): the pinned compile error, the pinned library
        from a sealed copy of the bytes its digest names (`pinned`), or else a build of this process."""
        pin = self.pins.get(name)
        if pin and "failed" in pin:
            self.failed[name] = pin["failed"]
            raise BuildError(pin["failed"])
        data = pinned_bytes(self.programs, name, pin) if pin else None
        library = self.programs / f"{name}.so"
        if data is not None:
            with contextlib.suppress(Exception):   # a library that does not import: built again below
                loaded = load_sealed(name, data, lambda path: load_dispatched(name, path, pin["dispatcher"])
                                     if pin["dispatcher"] else _load_library(name, path, arguments["is_python_module"]))
                if self.on_library is not None:
                    self.on_library(data)
                return loaded if arguments["is_python_module"] else str(library)
        return self._build(name, arguments, library)

    def _rebuild(self, name: str, arguments: dict, cached: Path):
        """A cached library that does not import (`build_only` never imports what it builds) is
        removed and built again here, as a fast build that does not import is: then torch's way."""
        cached.unlink()
        return self._build(name, arguments, self.programs / f"{name}.so")

    def build_only(self, arguments: dict) -> str:
        """Build `arguments` (`self.arguments`) the fast way into the programs folder without loading
        it, for a builder that must run nothing a candidate wrote (`pool`'s trusted builder): "built"
        or "cached". Raises BuildError on a compile error torch's build shares (remembered as
        `load_inline` remembers it), Unsplittable or FastBuildFailed where only torch's build (which
        imports what it built) would do. A library that then does not import is built again by the
        worker (`load_inline`)."""
        name = self.name(arguments)
        library, generic = self.programs / f"{name}.so", self.programs / f"{name}.dispatch.so"
        with self._name_lock(name):
            if self.pins is None and (generic.exists() or library.exists()):
                return "cached"
            if self.pins is None and (self.programs / f"{name}.failed").exists():
                raise BuildError((self.programs / f"{name}.failed").read_text())
            build_dir = tempfile.mkdtemp(prefix="build-", dir=self.programs)
            start = time.perf_counter()
            try:
                built, report = fast_build(arguments, name, Path(build_dir), self.root, self.capability, self.slots,
                                           units=self._units(Path(build_dir)), seal=self.seal)
                self._place(name, built, library, report, Path(build_dir))
                self.history.append({"name": name, "how": "fast", "wall_s": time.perf_counter() - start, **report})
                return "built"
            except SharedCompileError as exc:
                raise self._shared_failure(name, exc, build_dir) from None
            finally:
                shutil.rmtree(build_dir, ignore_errors=True)

    @contextlib.contextmanager
    def _name_lock(self, name: str):
        """The name's build lock over every process of this cache; none in a candidate's own folder,
        whose builds share no file (`pinned`) and where another candidate may hold any lock."""
        if self.pins is not None:
            yield
            return
        folder = self.programs / "locks"
        folder.mkdir(exist_ok=True)
        with open(folder / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _units(self, build_dir: Path) -> Path:
        """Where a build's compiled units are kept: unsealed in a candidate's own folder, the build's
        alone (a unit object another candidate put there is never linked)."""
        return build_dir if self.pins is not None and self.seal is None else self.units

    def arguments(self, *args, **kwargs) -> dict:
        """load_inline's arguments by name, defaults filled in."""
        bound = inspect.signature(self.real_load_inline).bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def name(self, arguments: dict) -> str:
        """`dice_ext_<key>`: the key hashes the toolchain and the recipe, sources normalised."""
        recipe = {k: v for k, v in arguments.items() if k not in ("name", "build_directory", "verbose")}
        for k in ("cpp_sources", "cuda_sources"):
            text = [recipe[k]] if isinstance(recipe[k], str) else recipe[k]
            recipe[k] = [normalise(t) for t in text] if isinstance(text, (list, tuple)) and \
                all(isinstance(t, str) for t in text) else text
        key = hashlib.sha256(json.dumps([self.toolchain, recipe], sort_keys=True, default=repr).encode()).hexdigest()
        return f"dice_ext_{key[:24]}"

    def _build(self, name: str, arguments: dict, library: Path):
        build_dir = tempfile.mkdtemp(prefix="build-", dir=self.programs)
        torch_dir = os.path.join(build_dir, "torch")   # a folder of its own: the fast build's files stay apart
        start, reason = time.perf_counter(), "build=torch"
        try:
            if self.build == "fast":
                try:
                    return self._fast(name, arguments, library, Path(build_dir), start)
                except Unsplittable as exc:
                    reason = f"split refused: {exc}"
                except FastBuildFailed as exc:
                    first = next((line for line in str(exc).splitlines() if "error" in line), str(exc)[:200])
                    reason = f"fast build failed: {first.replace(build_dir + os.sep, '')[:300]}"
            # load_inline also imports what it built; the rename keeps that mapping valid.
            os.mkdir(torch_dir)
            loaded = self._torch_load_inline(**{**arguments, "name": name, "build_directory": torch_dir,
                                                "verbose": False})
            self._record(name, (Path(torch_dir) / f"{name}.so").read_bytes(), None)
            os.replace(Path(torch_dir) / f"{name}.so", library)
            self.history.append({"name": name, "how": "torch", "reason": reason,
                                 "wall_s": time.perf_counter() - start})
            return loaded if arguments["is_python_module"] else str(library)
        except (BuildError, SharedCompileError) as exc:
            if isinstance(exc, SharedCompileError):
                self.history.append({"name": name, "how": "fast", "reason": "compile error torch's build shares",
                                     "wall_s": time.perf_counter() - start})
                raise self._shared_failure(name, exc, build_dir) from None
            self.failed[name] = str(exc)
            raise BuildError(self.failed[name]) from None
        except Exception as exc:
            self.failed[name] = build_error_message(str(exc), torch_dir)
            if LOCATED_ERROR.search(str(exc)) and not TRANSIENT.search(str(exc)):
                self._remember_failure(name, build_dir)
            raise BuildError(self.failed[name]) from None
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)

    def _shared_failure(self, name: str, exc: SharedCompileError, build_dir: str) -> BuildError:
        """The BuildError of a compile error torch's build shares, remembered in this process and, unless
        transient, for every process of the cache (`<name>.failed`)."""
        self.failed[name] = build_error_message(str(exc), build_dir)
        if not TRANSIENT.search(str(exc)):
            self._remember_failure(name, build_dir)
        return BuildError(self.failed[name])

    def _remember_failure(self, name: str, build_dir: str) -> None:
        """`<name>.failed` with the message, written atomically (under the name's lock)."""
        Path(build_dir, "failed").write_text(self.failed[name])
        os.replace(Path(build_dir, "failed"), self.programs / f"{name}.failed")
        self.made[name] = {"failed": self.failed[name]}

    def _fast(self, name: str, arguments: dict, library: Path, build_dir: Path, start: float):
        """The fast build, imported from build_dir (an import failure is a FastBuildFailed too)."""
        built, report = fast_build(arguments, name, build_dir, self.root, self.capability, self.slots,
                                   units=self._units(build_dir), seal=self.seal)
        try:
            loaded = (load_dispatched(name, built, report["dispatcher"]) if report["dispatcher"] else
                      _load_library(name, built, arguments["is_python_module"]))
        except Exception as exc:
            raise FastBuildFailed(f"the split build did not import: {exc}") from None
        self._place(name, built, library, report, build_dir)
        self.history.append({"name": name, "how": "fast", "wall_s": time.perf_counter() - start, **report})
        return loaded if arguments["is_python_module"] else str(library)

    def _place(self, name: str, built: Path, library: Path, report: dict, build_dir: Path) -> None:
        """Move a fast build's library into the cache (atomic renames; with the generic binding as
        `<name>.dispatch.so`, its dispatcher's path beside it first: a library in place always has one),
        recording its digest in `made`."""
        self._record(name, built.read_bytes(), report["dispatcher"] or None)
        if report["dispatcher"]:
            library = library.with_suffix(".dispatch.so")
            Path(build_dir, "dispatcher").write_text(report["dispatcher"])
            os.replace(Path(build_dir, "dispatcher"), f"{library}.dispatcher")
        os.replace(built, library)

    def _record(self, name: str, data: bytes, dispatcher: str | None) -> None:
        """A library this cache built: its digest in `made`, its bytes to `on_library` (the worker's
        kernel names, read from what was built rather than from a file another process can change)."""
        self.made[name] = {"sha256": digest(data), "dispatcher": dispatcher}
        if self.on_library is not None:
            self.on_library(data)

    def _torch_load_inline(self, **arguments):
        """torch's load_inline; without visible GPUs (a prebuild) torch needs the architecture list."""
        if os.environ.get("TORCH_CUDA_ARCH_LIST") or self.capability is None or torch.cuda.device_count():
            return self.real_load_inline(**arguments)
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{self.capability[0]}.{self.capability[1]}+PTX"
        try:
            return self.real_load_inline(**arguments)
        finally:
            del os.environ["TORCH_CUDA_ARCH_LIST"]


def _load_library(name: str, library: Path, is_python_module: bool):
    """Import a cached build the way load_inline would have returned it."""
    if not is_python_module:
        torch.ops.load_library(str(library))
        return str(library)
    # the loader named: a sealed copy's path (`pinned`) has no suffix to choose it by
    spec = importlib.util.spec_from_file_location(
        name, library, loader=importlib.machinery.ExtensionFileLoader(name, str(library)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class UntrustedArtifact(Exception):
    """A toolchain artifact in the shared cache is not what its trusted build made (`toolchain.TRUSTED`)."""


def load_dispatched(name: str, library: Path, dispatcher: str) -> types.ModuleType:
    """A library with the generic binding as the module load_inline would return: its functions
    made by the dice_dispatch extension at `dispatcher` (dispatch.cpp), imported once per process.
    Where `toolchain.TRUSTED` is set, the dispatcher is imported from a private copy of the bytes
    its trusted build made, else UntrustedArtifact (DESIGN.md §8.4)."""
    module = sys.modules.get("dice_dispatch")
    if module is None or getattr(module, "dice_source", None) != dispatcher:
        path, private = _trusted_copy(Path(dispatcher))
        try:
            spec = importlib.util.spec_from_file_location("dice_dispatch", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            if private:
                shutil.rmtree(path.parent, ignore_errors=True)   # the mapping stays; the file need not
        module.dice_source = dispatcher
        sys.modules["dice_dispatch"] = module
    loaded = types.ModuleType(name)
    loaded.__file__ = str(library)
    for function, call in module.load(str(library)):
        setattr(loaded, function, call)
    return loaded


def _trusted_copy(path: Path) -> tuple[Path, bool]:
    """(`path`, False) where no artifact is trusted by digest (`toolchain.TRUSTED` None), else a
    private copy of its bytes, checked against the digest its trusted build recorded, and True."""
    if toolchain.TRUSTED is None:
        return path, False
    data = path.read_bytes()
    if toolchain.TRUSTED.get(str(path.relative_to(path.parents[2]))) != hashlib.sha256(data).hexdigest():
        raise UntrustedArtifact(f"{path} is not the file its trusted build made")
    copy = Path(tempfile.mkdtemp(prefix="dice-trusted-")) / path.name
    copy.write_bytes(data)
    return copy, True


def build_error_message(log: str, build_dir: str) -> str:
    log = log.replace(build_dir + os.sep, "")
    errors = [line.strip() for line in log.splitlines()
              if re.search(r"\berror\b|undefined (symbol|reference)", line, re.IGNORECASE)
              and not line.startswith("Error building extension") and len(line) < 500]
    lines = errors or log.strip().splitlines()[-MAX_MESSAGE_LINES:]
    return ("load_inline build failed (cuda.cu = cuda_sources after 3 #include lines torch adds, "
            "main.cpp = cpp_sources after 1):\n" + "\n".join(lines[:MAX_MESSAGE_LINES]))


def nvrtc_error_message(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()] or lines
    return "NVRTC could not compile the CUDA source:\n" + "\n".join(errors[:MAX_MESSAGE_LINES])


def is_nvrtc_error(exc: BaseException) -> bool:
    return type(exc).__name__ == "CompileException"  # cupy.cuda.compiler.CompileException
