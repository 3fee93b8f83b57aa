"""`python -m meshtrain.launch --nprocs N [--devices-per-process K] run_training.py [overrides...]`
(or `meshtrain-launch`): the processes of one training run on this machine
(meshtrain.distributed.launcher; docs/multi-node.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from meshtrain.cli.exit import fail
from meshtrain.distributed.launcher import LaunchOptions, launch
from meshtrain.errors import ConfigError
from meshtrain.prog import prog_name


def parse_args(argv: Sequence[str]) -> LaunchOptions:
    parser = argparse.ArgumentParser(
        prog=prog_name("meshtrain.launch"),
        description="Run the processes of one training run on this machine (docs/multi-node.md).",
    )
    parser.add_argument("--nprocs", type=int, required=True, help="processes on this machine")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=1,
        help="devices of each process: faked CPU devices, or GPUs (default 1)",
    )
    parser.add_argument(
        "--platform",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="auto (default): GPUs if the machine has any, else faked CPU devices",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=10.0,
        help="seconds the other processes get to exit after SIGTERM when one fails (default 10)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show Gloo's '[Gloo] Rank N is connected to ...' lines (hidden by default)",
    )
    parser.add_argument("script", help="the training script, e.g. run_training.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (Hydra overrides)")
    args = parser.parse_args(argv)
    if args.nprocs < 1:
        parser.error(f"--nprocs {args.nprocs} must be at least 1")
    if args.devices_per_process < 1:
        parser.error(f"--devices-per-process {args.devices_per_process} must be at least 1")
    return LaunchOptions(**vars(args))


def main(argv: Sequence[str] | None = None) -> None:
    try:
        sys.exit(launch(parse_args(sys.argv[1:] if argv is None else argv)))
    except ConfigError as err:
        fail(str(err))


if __name__ == "__main__":
    main()
