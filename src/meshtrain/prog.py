"""The program name a command's usage and error lines show: what the user typed."""

from __future__ import annotations

import os
import sys

CONSOLE_SCRIPT_PREFIX = "meshtrain-"


def prog_name(module: str, argv0: str | None = None) -> str:
    """argparse's `prog` for the command of `module` ("meshtrain.launch"): the console script's
    name when the user ran one (meshtrain-launch), else `python -m <module>`. `argv0` defaults
    to sys.argv[0]."""
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    if name.startswith(CONSOLE_SCRIPT_PREFIX):
        return name.removesuffix(".exe")
    return f"python -m {module}"
