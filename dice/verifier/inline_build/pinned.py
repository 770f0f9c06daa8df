"""A candidate's own programs folder, used only as its builds made it (DESIGN.md §8.4).

Each load_inline candidate builds in a folder of its own (`Verifier._verify_one`), but every
candidate's process runs as the same user and can list the folders of the others and write into
them: rename a sibling's library away and leave a `.failed` marker (its verdict becomes
compile_error), hold its build lock (it times out), or put a unit object or library of its own
there. So in such a folder a `BuildCache` given `pins` trusts nothing it finds on disk:

- the builds that serve the candidate ahead of its worker (the prebuild child, the trusted builder:
  `pool`) start from `pins={}`: they build every program afresh and record what they made, the
  sha256 of each library they placed (and its dispatcher, for the generic binding) or the message
  of a compile error (`BuildCache.made`), which their report carries to the verifier;
- the worker gets those pins from the verifier with the candidate's load request. A pinned library
  is read once, checked against its digest, and loaded from a sealed in-memory copy
  (`sealed_copy`: no process can change the bytes between the check and the load); a pinned
  compile error is reported as it was made. Anything else (no pin, a digest that does not match, a
  file gone) is built again in the worker's own process, on units compiled for that build alone.

No per-name lock is taken in such a folder: its builds never share a file (each builds in a fresh
`build-*` folder and loads its own result), so a lock another process holds cannot stall them.
What stays open (DESIGN.md §8.7): a process of the same user may still change a file inside a
sibling's `build-*` folder while that build runs, a race against the compiler.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path
from typing import Callable

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def digest(data: bytes) -> str:
    """The sha256 a pin records for a library's bytes."""
    return hashlib.sha256(data).hexdigest()


def valid_pins(pins) -> dict[str, dict]:
    """The pins of a prebuild's report as the worker may use them: {name: {"sha256": hex, "dispatcher":
    path or None}} or {name: {"failed": message}}; anything else is left out (then built again)."""
    if not isinstance(pins, dict):
        return {}
    kept = {}
    for name, pin in pins.items():
        if not (isinstance(name, str) and name.startswith("dice_ext_") and isinstance(pin, dict)):
            continue
        if isinstance(pin.get("failed"), str):
            kept[name] = {"failed": pin["failed"]}
        elif isinstance(pin.get("sha256"), str) and isinstance(pin.get("dispatcher"), (str, type(None))):
            kept[name] = {"sha256": pin["sha256"], "dispatcher": pin["dispatcher"]}
    return kept


def pinned_bytes(programs: Path, name: str, pin: dict) -> bytes | None:
    """The pinned library's bytes, read once, or None where it is gone or is not what was pinned."""
    library = programs / (f"{name}.dispatch.so" if pin.get("dispatcher") else f"{name}.so")
    try:
        data = library.read_bytes()
    except OSError:
        return None
    return data if digest(data) == pin["sha256"] else None


def sealed_copy(data: bytes, name: str) -> int:
    """A file descriptor of an in-memory file holding `data`, sealed against every change, to load
    through `/proc/self/fd/<fd>`."""
    fd = os.memfd_create(f"{name}.so", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def load_sealed(name: str, data: bytes, load: Callable[[Path], object]):
    """`load(path)` of a sealed in-memory copy of `data` (`sealed_copy`). Its descriptor stays open for
    the process's life: the dynamic loader takes a path it loaded before for the same library, and a
    closed descriptor's number, so its path, would come back for the next one."""
    fd = sealed_copy(data, name)
    try:
        return load(Path(f"/proc/self/fd/{fd}"))
    except BaseException:
        os.close(fd)
        raise
