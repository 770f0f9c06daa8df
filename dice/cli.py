"""What the commands share: their argument parser, and turning the errors a user can act on into one line.

Exit status: 2 for a usage error (a wrong, missing or conflicting flag, a value out of its range,
an output path that cannot be written as asked: argparse's own errors, `usage_error` and
`dice.errors.UsageError`), 1 for a failure (an input file, model or machine that does not fit:
any other `UserError`, and the file system's own refusals, `fail_cleanly`), 130 for Ctrl-C.
"""
from __future__ import annotations

import argparse
import errno
import math
import sys
import time

from .errors import UsageError, UserError

USER_ERRORS = (UserError, FileNotFoundError)
# what the file system refuses, and the fix; any other OSError is a bug and keeps its traceback
FILE_SYSTEM_FIXES = {errno.EACCES: "fix its permissions or choose another path",
                     errno.EPERM: "fix its permissions or choose another path",
                     errno.EROFS: "the file system is read-only: choose a path on another one",
                     errno.ENOSPC: "free some disk space or choose a path on another disk",
                     errno.EDQUOT: "free some of your disk quota or choose a path on another disk",
                     errno.EISDIR: "it is a folder: give a file",
                     errno.ENOTDIR: "a part of the path is a file: give a path through folders",
                     errno.ENAMETOOLONG: "give a shorter path"}


def usage_error(prog: str, message: str):
    """Print `prog: error: message (see prog --help)` and exit with status 2."""
    print(f"{prog}: error: {message} (see {prog} --help)", file=sys.stderr)
    sys.exit(2)


def fail_cleanly(main) -> None:
    """Run `main()`; an error the user can fix is printed as one line (module docstring: exit status
    2 for a UsageError, 1 for other user errors and the file system's refusals). Ctrl-C prints
    "interrupted", with what to do next when the KeyboardInterrupt carries it (train.py: resume)."""
    try:
        main()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        if e.errno not in FILE_SYSTEM_FIXES:
            raise
        where = f"{e.filename}: " if e.filename else ""
        sys.exit(f"error: {where}{e.strerror}; {FILE_SYSTEM_FIXES[e.errno]}")
    except KeyboardInterrupt as e:
        print(f"interrupted{f'; {e}' if str(e) else ''}", file=sys.stderr)
        sys.exit(130)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every flag's default, except None, "" (no value), False (a switch that is off) and
    where the help text states it already ("(default: ...)")."""

    def _get_help_string(self, action):
        if action.default in (None, "") or action.default is False or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults in --help and one-line errors (train.py's usage alone is two dozen lines)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        usage_error(self.prog, message)


def at_least(low, kind=int):
    """An argparse `type`: a finite `kind` number >= `low`."""
    return in_range(low, None, kind)


def in_range(low, high, kind=float, *, above: bool = False):
    """An argparse `type`: a finite `kind` number in [low, high] (`above`: (low, high]; None: no bound)."""
    lowest = f"> {low}" if above else f">= {low}"
    rule = lowest if high is None else f"in {'(' if above else '['}{low}, {high}]"

    def convert(text: str):
        value = kind(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (above and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    convert.__name__ = kind.__name__      # argparse names the type in "invalid int value: 'x'"
    return convert


class ProgressLine:
    """A status line on stderr: redrawn in place on a terminal; in a log (stderr not a TTY) written as
    a new line at most every `every_s` seconds (and at an update with `force`: a milestone whose time a
    log must keep) and once more at `close`, so a log keeps a few lines instead of one
    carriage-return-joined line per update."""

    def __init__(self, every_s: float = 10.0):
        self.live = sys.stderr.isatty()
        self.every_s, self.last, self.text, self.written = every_s, -math.inf, "", ""

    def update(self, text: str, force: bool = False) -> None:
        self.text = text
        if self.live:
            print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)
        elif force or time.monotonic() - self.last >= self.every_s:
            self.last, self.written = time.monotonic(), text
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.live:
            print(file=sys.stderr, flush=True)
        elif self.text != self.written:
            print(self.text, file=sys.stderr, flush=True)


def eta(left: float, rate: float) -> str:
    """`left` units at `rate` per second, as 1m05s."""
    seconds = int(left / rate) if rate > 0 else 0
    return f"{seconds // 60}m{seconds % 60:02d}s"
