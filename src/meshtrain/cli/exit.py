"""The one way an entry point stops on bad input: one line on stderr, a chosen exit code."""

from __future__ import annotations

import sys
from typing import NoReturn

from meshtrain.errors import error_line

EXIT_CONFIG_ERROR = 2
# training.nonfinite=stop met a NaN/Inf; a run stopped by a signal exits 128 + signum.
EXIT_NONFINITE = 3


def fail(message: str, code: int = EXIT_CONFIG_ERROR) -> NoReturn:
    """Prints `meshtrain: error: <message>` and exits with `code`."""
    print(error_line(message), file=sys.stderr)
    sys.exit(code)
