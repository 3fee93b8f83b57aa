"""training.epochs: passes over the training sequences instead of a number of steps. The
steps follow once the data is read (train.setup.prepare), and the run records them."""

from __future__ import annotations

import dataclasses
import math

from meshtrain.config.schema import Config
from meshtrain.errors import require


def check_epochs(cfg: Config) -> None:
    """training.epochs, if set, is positive and names passes over one source."""
    epochs = cfg.training.epochs
    if epochs is None:
        return
    require(epochs > 0, f"training.epochs={epochs} must be positive")
    require(
        not cfg.data.mixture,
        f"training.epochs={epochs} cannot apply to data.mixture, which draws its sources by "
        "weight (no pass over them ends); set training.steps instead",
    )


def epoch_steps(epochs: float, sequences: int, global_batch: int) -> int:
    """training.steps of `epochs` passes over `sequences` training sequences: the updates that
    draw epochs × sequences of them, the last one whole."""
    return max(1, math.ceil(epochs * sequences / global_batch - 1e-9))


def with_epoch_steps(cfg: Config, sequences: int, global_batch: int) -> Config:
    """`cfg` with training.steps set from training.epochs (unchanged where that is null)."""
    if cfg.training.epochs is None:
        return cfg
    steps = epoch_steps(cfg.training.epochs, sequences, global_batch)
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, steps=steps))
