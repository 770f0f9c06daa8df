"""Compiling candidates: a load_inline build cache and compiler messages a person can act on (DESIGN.md §8).

Runs inside candidate workers. `BuildCache.install()` replaces
`torch.utils.cpp_extension.load_inline` so that candidate code building an extension goes through
the cache; CuPy (NVRTC) keeps its own kernel cache and only needs its errors worded here.
"""

from __future__ import annotations

import hashlib
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

STALE_BUILD_S = 3600.0  # build-* folders older than this were left by killed builds
MAX_MESSAGE_LINES = 25


class BuildError(Exception):
    """A load_inline build failed; the message holds the compiler's error lines."""


class BuildCache:
    """`torch.utils.cpp_extension.load_inline` with a cache keyed by sources + flags + toolchain.

    Each build runs in its own fresh `build-*` folder (torch's FileBaton lock lives there, so a
    killed build never blocks a later one) under a unique module name `dice_ext_<hash>`; the .so
    is then moved into the cache with an atomic rename. Identical sources reuse it."""

    def __init__(self, root: Path, device: torch.device):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        now = time.time()
        for stale in root.glob("build-*"):
            try:
                if now - stale.stat().st_mtime > STALE_BUILD_S:
                    shutil.rmtree(stale, ignore_errors=True)
            except FileNotFoundError:  # another worker removed it first
                pass
        self.toolchain = [torch.__version__, torch.version.cuda, sys.version.split()[0],
                          list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
                          os.environ.get("TORCH_CUDA_ARCH_LIST")]
        self.loaded: dict[str, types.ModuleType] = {}
        self.failed: dict[str, str] = {}  # torch will not rebuild a name it saw before in this process
        self.real_load_inline = torch.utils.cpp_extension.load_inline

    def install(self) -> None:
        """Make `from torch.utils.cpp_extension import load_inline` in candidate code hit the cache."""
        torch.utils.cpp_extension.load_inline = self.load_inline

    def load_inline(self, *args, **kwargs):
        bound = inspect.signature(self.real_load_inline).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        recipe = {k: v for k, v in arguments.items() if k not in ("name", "build_directory", "verbose")}
        key = hashlib.sha256(json.dumps([self.toolchain, recipe], sort_keys=True, default=repr).encode()).hexdigest()
        name = f"dice_ext_{key[:24]}"
        if name in self.failed:
            raise BuildError(self.failed[name])
        if name not in self.loaded:
            library = self.root / f"{name}.so"
            if library.exists():
                self.loaded[name] = _load_library(name, library, arguments["is_python_module"])
            else:
                self.loaded[name] = self._build(name, arguments, library)
        return self.loaded[name]

    def _build(self, name: str, arguments: dict, library: Path):
        build_dir = tempfile.mkdtemp(prefix="build-", dir=self.root)
        try:
            # load_inline also imports what it built; the rename keeps that mapping valid.
            loaded = self.real_load_inline(**{**arguments, "name": name, "build_directory": build_dir,
                                              "verbose": False})
            os.replace(Path(build_dir) / f"{name}.so", library)
            return loaded if arguments["is_python_module"] else str(library)
        except Exception as exc:
            self.failed[name] = build_error_message(str(exc), build_dir)
            raise BuildError(self.failed[name]) from None
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)


def _load_library(name: str, library: Path, is_python_module: bool):
    """Import a cached build the way load_inline would have returned it."""
    if not is_python_module:
        torch.ops.load_library(str(library))
        return str(library)
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
