"""What every experiment tracker is told about a run (RunInfo), the names its metrics take in
each of them (metric_tag) and the config as they show it (flat_config); the Tracker interface
that observe.trackers.tensorboard, observe.trackers.wandb_tracker and observe.trackers.mlflow_tracker implement
(observe.trackers opens them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from meshtrain.config.resume import flatten

# Hydra's layouts: outputs/<experiment>/<date>/<time>, multirun/<experiment>/<date>/<time>/<job>.
_OUTPUT_ROOTS = ("outputs", "multirun")


class Tracker(Protocol):
    """A sink of the logged steps."""

    def write(self, step: int, values: Mapping[str, float]) -> None:
        """Step `step`'s metrics, by their tracker names (metric_tag)."""

    def close(self, *, failed: bool) -> None:
        """Ends the tracker's run; `failed`: the training raised."""


@dataclass(frozen=True)
class RunInfo:
    """What every tracker is told about the run."""

    run_dir: Path
    name: str  # run_name(): TensorBoard's name of the run under `tensorboard --logdir outputs/`
    experiment: str  # experiment.name
    start_step: int = 0  # the checkpoint step a resumed run starts from
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config, nested


def metric_tag(name: str) -> str:
    """The name a metric has in every tracker: val_loss → val/loss, loss → train/loss;
    eval/<task>/<metric> (eval.harness) as it is."""
    if name.startswith("eval/"):
        return name
    return f"val/{name[4:]}" if name.startswith("val_") else f"train/{name}"


def run_name(run_dir: Path, experiment: str) -> str:
    """The run's name: its directory below outputs/ (or multirun/), as TensorBoard names it
    under `tensorboard --logdir outputs/` (e.g. tiny/2026-01-31/12-00-00); for a directory
    elsewhere (hydra.run.dir=...), <experiment>/<the directory's name>."""
    parts = Path(run_dir).absolute().parts
    for index in range(len(parts) - 2, -1, -1):
        if parts[index] in _OUTPUT_ROOTS:
            return "/".join(parts[index + 1 :])
    return f"{experiment}/{Path(run_dir).name}"


def flat_config(config: Mapping[str, Any]) -> dict[str, str]:
    """The config as "section.key" → value text (JSON for anything not a string), a mixture's
    entries as data.mixture.0.weight: MLflow's params, TensorBoard's config table."""
    flat = {}
    for key, value in flatten(config).items():
        name = key.replace("[", ".").replace("]", "")
        flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat
