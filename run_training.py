"""Train a language model with meshtrain: `python run_training.py [overrides...]` (see README)."""

from pathlib import Path

from meshtrain.cli.train import make_main

main = make_main(Path(__file__).parent / "configs")

if __name__ == "__main__":
    main()
