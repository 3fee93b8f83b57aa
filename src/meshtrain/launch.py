"""`python -m meshtrain.launch`: the same command as `meshtrain-launch` (meshtrain.cli.launch)."""

import sys

from meshtrain.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
