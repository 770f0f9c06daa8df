"""The path checks of every command's validation layer, run before any work or write.

Inputs (`input_path`): the path exists, is of the kind its flag needs (a file or a folder) and is
readable; otherwise an `InputError` (exit status 1) naming the flag, the path and what to give.

Outputs: nothing the user made is overwritten. A command writes a file (`output_file`) or a set
of entries of a folder (`output_folder`, e.g. taskgen's four .json files, a run folder's
`final/`, `metrics.jsonl`, ...) only where nothing is yet: an existing file it would write, or an
existing entry of a folder it would replace, is refused unless `--overwrite` (which replaces
those entries and nothing else), as a run folder refuses an earlier run (`dice.run_folder`). An
output is also refused when it is, or lies inside, one of the command's inputs (a task file, a
KernelBench or model folder), when the path is of the wrong kind (a folder where a file is
written or the reverse), when its folder does not exist, and when that folder is not writable.
Every refusal is a `UsageError` (exit status 2) and touches nothing.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

from .errors import UsageError, UserError


class InputError(UserError):
    """An input path that is missing, of the wrong kind or unreadable."""


def input_path(path: str | os.PathLike, flag: str, kind: str, give: str) -> Path:
    """`path` as a Path when it exists, is a `kind` ("file", "folder" or "any") and is readable;
    else an InputError that names `flag` and ends with `give` (what to pass instead)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{flag} {path} does not exist; {give}")
    if kind == "file" and path.is_dir():
        raise InputError(f"{flag} {path} is a folder, not a file; {give}")
    if kind == "folder" and not path.is_dir():
        raise InputError(f"{flag} {path} is a file, not a folder; {give}")
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise InputError(f"{flag} {path} is not readable (permission denied); fix its permissions or copy it")
    return path


def _named(flag: str) -> str:
    """How a refusal names the output: `argument --out`, or a phrase such as "the default output
    folder runs/sft-<time>" for a path the user never gave (which they fix by passing the flag)."""
    return f"argument {flag}" if flag.startswith("-") else f"{flag} (pass --out DIR to choose another)"


def _inside_an_input(path: Path, flag: str, inputs: Mapping[str, str | os.PathLike | None]) -> None:
    """Refuse an output that is an input, or lies inside an input folder."""
    target = path.resolve()
    for input_flag, source in inputs.items():
        if not source or not Path(source).exists():
            continue
        source = Path(source).resolve()
        if target == source or (source.is_dir() and target.is_relative_to(source)):
            where = "is" if target == source else "is inside"
            raise UsageError(f"{_named(flag)}: {path} {where} the input {input_flag} {source}; "
                             "write outputs elsewhere, never into an input")


def _writable_folder(folder: Path, flag: str, path: Path) -> None:
    """The nearest existing folder on the way to `folder` must be a folder we may write into."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{_named(flag)}: {existing} on the way to {path} is a file; give a path through folders")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{_named(flag)}: {existing} is not writable; fix its permissions or choose another path")


def output_file(path: str | os.PathLike, flag: str, *, overwrite: bool,
                inputs: Mapping[str, str | os.PathLike | None] | None = None) -> Path:
    """Check a file the command will write (module docstring); its folder must exist already."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{_named(flag)}: {path} is a folder; give the path of a file to write")
    if not path.resolve().parent.is_dir():
        raise UsageError(f"{_named(flag)}: the folder of {path} does not exist; create it or choose another path")
    _inside_an_input(path, flag, inputs or {})
    _writable_folder(path.resolve().parent, flag, path)
    if path.exists() and not overwrite:
        raise UsageError(f"{_named(flag)}: {path} already exists; pass --overwrite to replace it, or choose "
                         "another path")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{_named(flag)}: {path} is not writable (permission denied), so --overwrite cannot "
                         "replace it; fix its permissions or choose another path")
    return path


def output_folder(path: str | os.PathLike, flag: str, entries: Iterable[str], *, overwrite: bool,
                  inputs: Mapping[str, str | os.PathLike | None] | None = None) -> list[str]:
    """Check a folder the command will write `entries` (names relative to it) into (module
    docstring); it may exist, and is created with its parents. Returns the entries that exist
    already: with `overwrite` the caller replaces those."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{_named(flag)}: {path} is a file; give a folder")
    _inside_an_input(path, flag, inputs or {})
    _writable_folder(path, flag, path)
    found = [name for name in entries if (path / name).exists() or (path / name).is_symlink()]
    if found and not overwrite:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise UsageError(f"{_named(flag)}: {path} already holds {shown}, which this command would replace; pass "
                         "--overwrite to replace them, or choose another folder")
    replaceable(path, found, flag, inputs or {})
    return found


def replaceable(path: Path, names: Iterable[str], flag: str, inputs: Mapping[str, str | os.PathLike | None]) -> None:
    """Refuse to let --overwrite replace an entry of `path` that is, or holds, one of the inputs (a
    run's final/ that is the --model being trained)."""
    for name in names:
        entry = (path / name).resolve()
        for input_flag, source in inputs.items():
            if source and Path(source).exists():
                source = Path(source).resolve()
                if source == entry or source.is_relative_to(entry):
                    raise UsageError(f"{_named(flag)}: --overwrite would replace {path / name}, which holds the input "
                                     f"{input_flag} {source}; copy that input elsewhere first, or choose another "
                                     f"{flag if flag.startswith('-') else '--out'}")
