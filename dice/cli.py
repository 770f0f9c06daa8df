"""What the commands share: their argument parser, and turning the errors a user can act on into one line."""
from __future__ import annotations

import argparse
import sys

from .checkpoint import CheckpointError
from .data import DataError
from .tokenizer import TokenizerError

USER_ERRORS = (CheckpointError, DataError, TokenizerError, FileNotFoundError)


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
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def at_least(low, kind=int):
    """An argparse `type`: a `kind` number >= `low`."""
    def convert(text: str):
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value
    convert.__name__ = kind.__name__      # argparse names the type in "invalid int value: 'x'"
    return convert
