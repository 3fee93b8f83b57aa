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
from pathlib import Path
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
    if "mlflow" in logging.trackers and (problem := mlflow_store_problem(logging.mlflow)):
        raise ConfigError(problem)
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


def mlflow_store_problem(
    settings: MlflowConfig, environ: Mapping[str, str] | None = None
) -> str | None:
    """The one line that refuses an MLflow store the run could not open, checked before
    anything compiles (None: nothing found): a file store (a `file:` URI or a bare path), which
    MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true, or an SQLite database whose file or
    directory this process cannot write. A server's URI is not checked (that needs the
    network); the run's own default store is in the run directory, checked with it."""
    environ = os.environ if environ is None else environ
    uri = settings.tracking_uri or environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return None
    key = "logging.mlflow.tracking_uri" if settings.tracking_uri else "MLFLOW_TRACKING_URI"
    parsed = urlparse(uri)
    bare_path = not parsed.scheme and uri != "databricks"  # MLflow reads a bare path as files
    file_store = parsed.scheme == "file" or bare_path
    allowed = environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")
    if file_store and not allowed:
        return (
            f"{key}={uri} is an MLflow file store, which MLflow refuses (maintenance mode); use "
            "a database such as sqlite:///<dir>/mlflow.db (or leave it unset: the run's own "
            "mlflow.db), or set MLFLOW_ALLOW_FILE_STORE=true to use the file store anyway"
        )
    if parsed.scheme != "sqlite" or not uri.startswith("sqlite:///"):
        return None
    database = Path(uri.removeprefix("sqlite:///"))  # sqlite:////abs/path: an absolute path
    existing = database if database.exists() else _nearest_existing(database.parent)
    if existing is not None and not os.access(existing, os.W_OK):
        return (
            f"{key}={uri}: {existing} is not writable, so MLflow cannot write its database; "
            "give a database in a writable directory (sqlite:///<dir>/mlflow.db), or leave "
            "it unset for the run's own mlflow.db"
        )
    return None


def _nearest_existing(path: Path) -> Path | None:
    """`path` or its nearest ancestor that exists (the directory a new file would be made
    in, after any missing directories)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return None
