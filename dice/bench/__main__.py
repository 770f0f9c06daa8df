from ..cli import fail_cleanly
from . import main

fail_cleanly(main)
