"""Kernel names read from machine code and from the profiler (DESIGN.md §8.1): what `kernels`
compares to decide which kernels are the candidate's own.

- Entry points: the ELF symbols with STO_CUDA_ENTRY of every CUDA image in a cubin, a fatbin, a
  host shared library with embedded cubins, or the `.entry` directives of PTX (`entry_symbols`).
- Qualified names: namespaces kept, template arguments and parameters dropped, from the mangled
  symbol (`qualified_from_mangled`) and from the profiler's demangled name (`qualified_name`) alike.
- Library kernels: the names torch's own shared libraries and the CUDA wheels' hold, read from
  their read-only data, where nvcc's host code registers every kernel by its mangled name
  (`library_kernel_names`, `default_library_paths`).
"""
from __future__ import annotations

import functools
import os
import re
import struct
from pathlib import Path

import torch

STO_CUDA_ENTRY = 0x10
EM_CUDA = 190


def qualified_name(name: str) -> str:
    """`ns::kernel` of a profiler (demangled) kernel name: return type, template arguments and
    parameters dropped, `(anonymous namespace)::` removed. A plain C name stays as it is."""
    name = name.replace("(anonymous namespace)::", "").strip()
    name = re.sub(r"^void\s+", "", name)
    depth, out = 0, []
    for ch in name:
        if ch in "<(" and depth == 0:
            break
        out.append(ch)
    return "".join(out).strip()


def qualified_from_mangled(symbol: str) -> str:
    """`ns::kernel` of an Itanium-mangled kernel symbol (`_ZN3foo2nkEPi` -> `foo::nk`); an
    unmangled (extern "C") symbol is its own name."""
    if not symbol.startswith("_Z"):
        return symbol
    s, i = symbol, 2
    if s.startswith("L", i):
        i += 1
    nested = s.startswith("N", i)
    i += nested
    parts = []
    while i < len(s):
        if s.startswith("St", i):
            parts.append("std")
            i += 2
        elif s[i].isdigit():
            j = i
            while s[j].isdigit():
                j += 1
            length = int(s[i:j])
            part = s[j:j + length]
            if not part.startswith("_GLOBAL__N"):       # an anonymous namespace
                parts.append(part)
            i = j + length
        elif s[i] == "I":            # template arguments: skip to the matching E
            depth, i = 1, i + 1
            while i < len(s) and depth:
                depth += {"I": 1, "E": -1}.get(s[i], 0)
                i += 1
        else:
            break
        if not nested:
            break
    return "::".join(parts)


# ---------------------------------------------------------------------------------------------
# Machine code.

def entry_symbols(data: bytes) -> list[str]:
    """Kernel entry symbols of every CUDA ELF image in `data`: a cubin, a fatbin or a host shared
    library with embedded cubins, or PTX text (`.entry` directives)."""
    if not data.startswith(b"\x7fELF") and b".entry" in data and b".version" in data:
        return [m.decode() for m in re.findall(rb"\.entry\s+([\w$]+)", data)]
    found, start = [], data.find(b"\x7fELF")
    while start != -1:
        found += _cuda_elf_entries(data, start)
        start = data.find(b"\x7fELF", start + 4)
    return found


def _cuda_elf_entries(data: bytes, off: int) -> list[str]:
    """Entry symbols of the little-endian ELF64 image at `off` if it is a CUDA one, else []."""
    try:
        if data[off + 4] != 2 or data[off + 5] != 1 or struct.unpack_from("<H", data, off + 18)[0] != EM_CUDA:
            return []
        shoff, = struct.unpack_from("<Q", data, off + 0x28)
        entsize, count = struct.unpack_from("<HH", data, off + 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, off + shoff + k * entsize) for k in range(count)]
        names = []
        for sec in sections:
            if sec[1] != 2:                       # SHT_SYMTAB
                continue
            strtab = sections[sec[6]]
            for k in range(sec[5] // 24):
                st_name, info, other = struct.unpack_from("<IBB", data, off + sec[4] + 24 * k)
                if info & 0xF == 2 and other & STO_CUDA_ENTRY:     # functions marked as entry points
                    start = off + strtab[4] + st_name
                    names.append(data[start:data.index(b"\0", start)].decode(errors="replace"))
        return names
    except (struct.error, IndexError, ValueError):
        return []


MANGLED = re.compile(rb"(?<![A-Za-z0-9_])_Z[A-Za-z0-9_]{4,}")
SCAN_CHUNK = 4 * 2**20     # scanned a few MB at a time, so the scan lets the trainer's other threads run


def library_kernel_names(paths) -> frozenset[str]:
    """Qualified names of the kernels the shared libraries at `paths` hold (torch, cuBLAS, cuDNN):
    nvcc's host code registers every kernel by its mangled name, a string in the library's
    read-only data, so the names are read there (the device code itself is often a compressed
    fatbin). A candidate's kernel with one of these names is not its own: a launch of it may be
    the library's (PyTorch's anonymous-namespace kernels reduce to bare names). Read once per
    process for the same files (each Verifier asks: a trainer's, a bench's, a test session's)."""
    return _scanned(tuple((str(path), *_stamp(path)) for path in paths))


def _stamp(path) -> tuple:
    try:
        info = os.stat(path)
        return info.st_size, info.st_mtime_ns
    except OSError:
        return None, None


@functools.lru_cache(maxsize=4)
def _scanned(stamped: tuple) -> frozenset[str]:
    names = set()
    for path, *_ in stamped:
        try:
            with open(path, "rb") as f:
                for data in _read_only_sections(f):
                    start = 0
                    while start < len(data):
                        end = data.find(b"\0", start + SCAN_CHUNK)
                        end = len(data) if end < 0 else end
                        names.update(qualified_from_mangled(m.decode()) for m in MANGLED.findall(data, start, end))
                        start = end
        except OSError:
            continue
    names.discard("")
    return frozenset(names)


def _read_only_sections(f) -> list[bytes]:
    """The `.rodata*` sections of a little-endian ELF64 file (nothing for anything else)."""
    head = f.read(64)
    if len(head) < 64 or not head.startswith(b"\x7fELF") or head[4] != 2 or head[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", head, 0x28)
    entsize, count, names_at = struct.unpack_from("<HHH", head, 0x3A)
    f.seek(shoff)
    table = f.read(entsize * count)
    sections = [struct.unpack_from("<IIQQQQ", table, k * entsize) for k in range(count) if (k + 1) * entsize <= len(table)]
    if names_at >= len(sections):
        return []
    f.seek(sections[names_at][4])
    strings = f.read(sections[names_at][5])
    found = []
    for name_at, kind, _, _, offset, size in sections:
        name = strings[name_at:strings.find(b"\0", name_at)]
        if name.startswith(b".rodata") and kind != 8:      # 8: SHT_NOBITS
            f.seek(offset)
            found.append(f.read(size))
    return found


def default_library_paths() -> list[str]:
    """torch's own shared libraries and those of the CUDA wheels beside it (nvidia/*/lib)."""
    roots = [Path(torch.__file__).parent / "lib"]
    try:   # the CUDA wheels (nvidia-*) are optional: a system CUDA has none
        import nvidia
        roots += [Path(p) / name / "lib" for p in nvidia.__path__ for name in os.listdir(p)]
    except (ImportError, OSError):
        pass
    return sorted(str(f) for root in roots if root.is_dir() for f in root.iterdir() if ".so" in f.name)
