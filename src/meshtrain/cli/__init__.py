"""Entry points: `run_training.py` (train), generate, export and launch; each turns bad input
into one line on stderr and exit code 2 (meshtrain.cli.exit)."""
