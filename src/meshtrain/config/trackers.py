"""logging: the experiment trackers a run's metrics go to besides metrics.jsonl and train.log
(TensorBoard, W&B, MLflow), their keys and their start-up check. The trackers themselves are
meshtrain.observe.trackers and its modules; docs/profiling.md#experiment-trackers.

Keys left null defer to each tracker's own environment (WANDB_PROJECT, WANDB_ENTITY,
WANDB_MODE, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME), so a cluster's settings apply as
they would to any other program.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args
from urllib.parse import urlparse

from meshtrain.errors import ConfigError, require

Tracker = Literal["tensorboard", "wandb", "mlflow"]
"""An entry of logging.trackers."""
WandbMode = Literal["online", "offline", "disabled"]
"""logging.wandb.mode."""

# The module each tracker imports, and the pip requirement that installs it.
TRACKER_PACKAGES: dict[str, str] = {
    "tensorboard": "tensorboardX",
    "wandb": "wandb",
    "mlflow": "mlflow",
}
EXTRA = "trackers"  # pyproject's optional dependencies that install wandb and mlflow


@dataclass
class WandbConfig:
    """logging.wandb: the Weights & Biases run (logging.trackers=[..., wandb])."""

    project: str | None = None
    """W&B project; null: $WANDB_PROJECT, else meshtrain."""
    entity: str | None = None
    """W&B user or team; null: $WANDB_ENTITY, else your default entity."""
    name: str | None = None
    """Run name; null: the run's name, as TensorBoard shows it (<experiment.name>/<date>/<time>)."""
    tags: list[str] = field(default_factory=list)
    """Tags of the W&B run."""
    mode: str | None = None  # WandbMode
    """online, offline (the run is written under <run_dir>/wandb/; `wandb sync` uploads it) or disabled; null: $WANDB_MODE, else online."""


@dataclass
class MlflowConfig:
    """logging.mlflow: the MLflow run (logging.trackers=[..., mlflow])."""

    tracking_uri: str | None = None
    """Tracking server or store; null: $MLFLOW_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db (artifacts in <run_dir>/mlflow-artifacts/)."""
    experiment: str | None = None
    """MLflow experiment; null: $MLFLOW_EXPERIMENT_NAME, else experiment.name."""


@dataclass
class LoggingConfig:
    """logging: where each logged step's metrics go besides metrics.jsonl and train.log."""

    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])  # Tracker
    """Experiment trackers fed by process 0, each with the same metrics, config and run name: tensorboard, wandb, mlflow; [] for none."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """The W&B run: project, entity, name, tags, mode."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """The MLflow run: tracking_uri, experiment."""


def missing_package(tracker: str) -> str | None:
    """The module `tracker` needs, if it is not installed (looked up, not imported)."""
    module = TRACKER_PACKAGES[tracker]
    return None if importlib.util.find_spec(module) is not None else module


def check_logging(logging: LoggingConfig) -> None:
    """Every tracker named exists and its package is installed: one line naming the extra to
    install otherwise, before anything compiles."""
    names = get_args(Tracker)
    for tracker in logging.trackers:
        require(
            tracker in names,
            f"logging.trackers: {tracker!r} is not a tracker; use any of: {', '.join(names)} "
            "(e.g. 'logging.trackers=[tensorboard,wandb]')",
        )
    require(
        len(set(logging.trackers)) == len(logging.trackers),
        f"logging.trackers={logging.trackers} names a tracker twice; name each once",
    )
    for tracker in logging.trackers:
        module = missing_package(tracker)
        require(
            module is None,
            f"logging.trackers: {tracker} needs the {module} package, which is not installed; "
            f"pip install -e '.[{EXTRA}]' (or pip install {module}), or drop {tracker} from "
            "logging.trackers",
        )
    modes = get_args(WandbMode)
    mode = logging.wandb.mode
    require(
        mode is None or mode in modes,
        f"logging.wandb.mode={mode!r} is not supported; use one of: {', '.join(modes)}",
    )
    if "wandb" in logging.trackers and (host := wandb_login_missing(logging.wandb)):
        raise ConfigError(
            f"logging.trackers: wandb logs online but finds no login for {host} (no "
            "WANDB_API_KEY, no entry in ~/.netrc); run `wandb login`, set WANDB_API_KEY, or log "
            "offline with logging.wandb.mode=offline (`wandb sync` uploads it later)"
        )


def wandb_login_missing(
    settings: WandbConfig, environ: Mapping[str, str] | None = None
) -> str | None:
    """The W&B host an online run would log to without credentials (WANDB_API_KEY, or the
    host's entry in the netrc file where `wandb login` writes it), else None: checked before
    anything compiles, where W&B itself would stop the run only once it opens."""
    environ = os.environ if environ is None else environ
    mode = settings.mode or environ.get("WANDB_MODE") or "online"
    if mode not in ("online", "run") or environ.get("WANDB_API_KEY"):
        return None
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    try:
        found = netrc.netrc(environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        found = None
    return None if found else host
