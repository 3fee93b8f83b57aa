"""`python -m meshtrain.eval`: the same command as `meshtrain-eval` (meshtrain.cli.eval)."""

import sys

from meshtrain.cli.eval import main

if __name__ == "__main__":
    sys.exit(main())
