"""The base classes of errors a user can act on (DESIGN.md: one sentence naming the file or flag and the fix).

The commands (`dice.cli.fail_cleanly`) print such an error as one line: a `UsageError` (the
command line asks for something that cannot be done as asked: a flag's value, an output path)
exits with status 2, any other `UserError` (a file's content, a missing input, the machine) with
status 1; anything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A file, flag, model or machine the user can fix; the message says which, and how."""


class UsageError(UserError):
    """A flag or an output path that cannot be used as given; the message names it and the fix."""


def json_problem(error, line: int | None = None) -> str:
    """A JSONDecodeError as "<what> at line L column C" (`line`: the file's line number of a JSONL
    record, whose decoder counts from its own line 1), with no doubled "at" ("... starting at")."""
    where = f"line {line if line is not None else error.lineno} column {error.colno}"
    return f"{error.msg} {where}" if error.msg.endswith(" at") else f"{error.msg} at {where}"
