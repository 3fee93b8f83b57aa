"""`python -m meshtrain.generate`: the same command as `meshtrain-generate` (meshtrain.cli.generate)."""

import sys

from meshtrain.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
