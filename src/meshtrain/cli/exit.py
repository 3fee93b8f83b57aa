"""The one way an entry point stops on bad input: one line on stderr, a chosen exit code."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from meshtrain.errors import error_line

EXIT_CONFIG_ERROR = 2
# training.nonfinite=stop met a NaN/Inf; a run stopped by a signal exits 128 + signum.
EXIT_NONFINITE = 3
# A checkpoint write failed (disk full, read-only, no permission); the complete ones are intact.
# The same number as meshtrain.checkpoint.writes.CheckpointWriteError.exit_code.
EXIT_CHECKPOINT_WRITE = 4


def fail(message: str, code: int = EXIT_CONFIG_ERROR) -> NoReturn:
    """Prints `meshtrain: error: <message>` and exits with `code`."""
    print(error_line(message), file=sys.stderr)
    sys.exit(code)


def fail_now(message: str, code: int) -> NoReturn:
    """Like fail(), for a process whose background threads may never end: the log handlers and
    the standard streams are flushed, then the process ends without waiting for its threads
    (os._exit), and without the noise they would make at interpreter shutdown."""
    print(error_line(message), file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
