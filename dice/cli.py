"""What the three commands share: turning the errors a user can act on into one line."""
from __future__ import annotations

import sys

from .checkpoint import CheckpointError
from .data import DataError
from .tokenizer import TokenizerError

USER_ERRORS = (CheckpointError, DataError, TokenizerError, FileNotFoundError)


def fail_cleanly(main) -> None:
    """Run `main()`; an error the user can fix is printed as one line (exit status 2)."""
    try:
        main()
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
