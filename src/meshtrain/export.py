"""`python -m meshtrain.export`: the same command as `meshtrain-export` (meshtrain.cli.export)."""

import sys

from meshtrain.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
