"""Tiny training runs: in this process on its faked devices, and the metrics a run writes."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from helpers.config import compose_config
from meshtrain.train.loop import RunResult, train

# A short run of a one-layer tiny model on synthetic data: the shape of the multi-process tests.
SMALL_RUN = (
    "data=synthetic",
    "model.num_layers=1",
    "data.seq_len=32",
    "training.global_batch_size=8",
    "training.steps=3",
    "training.log_every=1",
    "training.warmup_steps=1",
    "training.eval_every=0",
)


def train_tiny(run_dir: Path, *overrides: str, devices: int | None = None) -> RunResult:
    """train() of the config `python run_training.py <overrides>` composes (the tiny model
    unless told otherwise), on this process's first `devices` devices (all of them by default)."""
    cfg = compose_config(*overrides)
    return train(cfg, run_dir, devices=jax.devices()[:devices])


def losses(path: Path) -> list[float]:
    """The losses of a metrics.jsonl, in the order logged."""
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]
