"""`python -m meshtrain.export <checkpoint> <out_dir> [--format orbax|safetensors|hf|peft]
[--merge]` (or
`meshtrain-export`): a checkpoint's parameters alone (meshtrain.inference.export)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import jax

from meshtrain.cli.exit import fail
from meshtrain.cli.train import skip_gpu_plugin_without_gpu
from meshtrain.errors import ConfigError
from meshtrain.inference.export import EXPORTERS, ExportError, export
from meshtrain.observe.metrics import setup_logging
from meshtrain.prog import prog_name

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog_name("meshtrain.export"),
        description="Write the parameters of a meshtrain checkpoint, without optimizer state.",
    )
    parser.add_argument("checkpoint", type=Path, help="checkpoint, checkpoints/ or run directory")
    parser.add_argument("out_dir", type=Path, help="new (or empty) directory to write")
    parser.add_argument("--format", default="orbax", choices=sorted([*EXPORTERS, "peft"]))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA checkpoint: fold the adapters into the base (W + alpha/r · A·B)",
    )
    args = parser.parse_args(argv)
    skip_gpu_plugin_without_gpu()  # before JAX starts: no CUDA failure printed on a CPU host
    setup_logging(None, is_main=True)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-phase INFO lines
    jax.config.update("jax_platforms", "cpu")  # whole arrays on the host; no accelerator needed
    try:
        source = export(args.checkpoint, args.out_dir, args.format, merge=args.merge)
    except (ExportError, ConfigError) as err:
        fail(str(err))
    log.info("exported the parameters of %s as %s to %s", source, args.format, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
