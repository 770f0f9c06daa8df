"""The errors a user can act on (DESIGN.md: one sentence naming the file or flag and the fix), and
`read_text`, the one reader of a user's text files, which raises them.

The commands (`dice.cli.fail_cleanly`) print such an error as one line: a `UsageError` (the
command line asks for something that cannot be done as asked: a flag's value, an output path)
exits with status 2, any other `UserError` (a file's content, a missing input, the machine) with
status 1; anything else is a bug and keeps its traceback.
"""
import json
from pathlib import Path


class UserError(ValueError):
    """A file, flag, model or machine the user can fix; the message says which, and how."""


class UsageError(UserError):
    """A flag or an output path that cannot be used as given; the message names it and the fix."""


class DataError(UserError):
    """A data or task file, a record, or a flag that does not fit them, that cannot be used; the
    message names the file, record or flag and the fix."""


def read_text(path: str | Path) -> str:
    """A UTF-8 text file; one that is not is a DataError naming it and the first bad byte."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); "
                        "save it as UTF-8") from None


def json_kind(value, shown: bool = False) -> str:
    """What a parsed JSON value is, in JSON's words with its article ("an object", "a number"; null,
    true and false as they are): a message about a user's file speaks of what the user wrote, not of
    Python's types. shown: the value's start follows in parentheses ("a number (5)")."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    kind = {dict: "an object", list: "a list", str: "a string"}.get(type(value), "a number")
    return f"{kind} ({json.dumps(value)[:40]})" if shown else kind


def json_problem(error, line: int | None = None) -> str:
    """A JSONDecodeError as "<what> at line L column C" (`line`: the file's line number of a JSONL
    record, whose decoder counts from its own line 1), with no doubled "at" ("... starting at")."""
    where = f"line {line if line is not None else error.lineno} column {error.colno}"
    return f"{error.msg} {where}" if error.msg.endswith(" at") else f"{error.msg} at {where}"
