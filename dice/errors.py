"""The one base class of errors a user can act on (DESIGN.md: one sentence naming the file or flag and the fix).

The commands (`dice.cli.fail_cleanly`) print such an error as one line and exit with status 1;
anything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A file, flag, model or machine the user can fix; the message says which, and how."""
