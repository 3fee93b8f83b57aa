"""The experiment trackers of a run (logging.trackers): TensorBoard, W&B and MLflow each get
every logged step's metrics under the same names, the run's resolved config and its name.

Only process 0 opens them (observe.metrics.MetricsWriter). Each lives in its own module,
imported only when named: observe.tensorboard, observe.wandb_tracker, observe.mlflow_tracker.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from meshtrain.config.resume import flatten
from meshtrain.config.trackers import EXTRA, LoggingConfig
from meshtrain.errors import ConfigError

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


def _open_tensorboard(settings: LoggingConfig, run: RunInfo) -> Tracker:
    from meshtrain.observe.tensorboard import TensorBoardTracker

    return TensorBoardTracker(run)


def _open_wandb(settings: LoggingConfig, run: RunInfo) -> Tracker:
    from meshtrain.observe.wandb_tracker import WandbTracker

    return WandbTracker(settings.wandb, run)


def _open_mlflow(settings: LoggingConfig, run: RunInfo) -> Tracker:
    from meshtrain.observe.mlflow_tracker import MlflowTracker

    return MlflowTracker(settings.mlflow, run)


_OPENERS: dict[str, Callable[[LoggingConfig, RunInfo], Tracker]] = {
    "tensorboard": _open_tensorboard,
    "wandb": _open_wandb,
    "mlflow": _open_mlflow,
}


def open_trackers(settings: LoggingConfig, run: RunInfo) -> list[Tracker]:
    """The trackers logging.trackers names, opened in its order (on process 0 only); if one
    fails to open, those opened before it are closed."""
    opened: list[Tracker] = []
    try:
        for name in settings.trackers:
            try:
                opened.append(_OPENERS[name](settings, run))
            except ModuleNotFoundError as err:  # installed when checked, broken since
                raise ConfigError(
                    f"logging.trackers: {name} cannot import {err.name}; "
                    f"pip install -e '.[{EXTRA}]', or drop {name} from logging.trackers"
                ) from err
    except BaseException:
        close_trackers(opened, failed=True)
        raise
    return opened


def close_trackers(trackers: Sequence[Tracker], *, failed: bool) -> None:
    """Closes every tracker, even when one of them raises (the first error is raised after)."""
    error: BaseException | None = None
    for tracker in trackers:
        try:
            tracker.close(failed=failed)
        except Exception as err:  # the others still close
            error = error or err
    if error is not None:
        raise error
