"""Fine-tunes a local Hugging Face checkpoint and writes the result as a new one.

    python examples/finetune_hf.py <hf dir> <out dir> model=<its config> [overrides...]

Runs what `python run_training.py model.init_from=hf:<hf dir> data.tokenizer=<hf dir> ...` runs
(logs and metrics in outputs/<experiment.name>/<date>/<time>/), then writes the final weights
and the tokenizer with `meshtrain.export_hf` into the new directory <out dir>, which
transformers.AutoModelForCausalLM.from_pretrained loads.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from meshtrain.cli.train import describe_config_error
from meshtrain.config.hydra import compose_config
from meshtrain.errors import ConfigError
from meshtrain.hf.save import export_hf
from meshtrain.train.loop import train


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", type=Path, help="local Hugging Face checkpoint to start from")
    parser.add_argument("out_dir", type=Path, help="new directory for the fine-tuned checkpoint")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for run_training.py")
    parser.add_argument(
        "--run-dir", type=Path, help="logs and metrics (default outputs/<experiment>/<date>/<time>)"
    )
    args = parser.parse_args()
    try:
        if args.out_dir.exists():
            raise ConfigError(f"{args.out_dir} already exists; export into a new directory")
        defaults = [f"model.init_from=hf:{args.hf_dir}", f"data.tokenizer={args.hf_dir}"]
        try:
            cfg = compose_config(*defaults, *args.overrides)
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(describe_config_error(err)) from None
        run_dir = args.run_dir or Path(
            "outputs", cfg.experiment.name, f"{datetime.now():%Y-%m-%d/%H-%M-%S}"
        )
        result = train(cfg, run_dir)
        out = export_hf(result.state.params, cfg.model, args.out_dir, cfg.data.tokenizer)
    except ConfigError as err:
        print(f"meshtrain: error: {err}", file=sys.stderr)
        return 2
    print(
        f"fine-tuned {args.hf_dir} for {cfg.training.steps} steps (run in {run_dir}); wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
