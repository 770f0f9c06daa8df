"""What the commands share: their argument parser, and turning the errors a user can act on into one line.

Exit status: 2 for a usage error (a wrong, missing or conflicting flag: argparse's own errors and
`usage_error`), 1 for a failure (a file, model or machine that does not fit: `fail_cleanly`).
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from .errors import UserError

USER_ERRORS = (UserError, FileNotFoundError)


def usage_error(prog: str, message: str):
    """Print `prog: error: message (see prog --help)` and exit with status 2."""
    print(f"{prog}: error: {message} (see {prog} --help)", file=sys.stderr)
    sys.exit(2)


def fail_cleanly(main) -> None:
    """Run `main()`; an error the user can fix is printed as one line (exit status 1)."""
    try:
        main()
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every flag's default, except None, "" (no value) and False (a switch that is off)."""

    def _get_help_string(self, action):
        if action.default in (None, "") or action.default is False:
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
    """An argparse `type`: a `kind` number >= `low`."""
    def convert(text: str):
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value
    convert.__name__ = kind.__name__      # argparse names the type in "invalid int value: 'x'"
    return convert


class ProgressLine:
    """A status line on stderr: redrawn in place on a terminal; in a log (stderr not a TTY) written as
    a new line at most every `every_s` seconds and once more at `close`, so a log keeps a few lines
    instead of one carriage-return-joined line per update."""

    def __init__(self, every_s: float = 10.0):
        self.live = sys.stderr.isatty()
        self.every_s, self.last, self.text, self.written = every_s, -math.inf, "", ""

    def update(self, text: str) -> None:
        self.text = text
        if self.live:
            print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)
        elif time.monotonic() - self.last >= self.every_s:
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
