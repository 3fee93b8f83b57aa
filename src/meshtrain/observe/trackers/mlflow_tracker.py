"""The MLflow tracker (logging.trackers=[..., mlflow]): one MLflow run per launch, with the
resolved config as params (flattened keys), each logged step's metrics at its step, and the run
directory as artifacts at the end.

The store is logging.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else a SQLite database in
the run directory (sqlite:///<run_dir>/mlflow.db, artifacts in <run_dir>/mlflow-artifacts/):
a run keeps everything in its own directory, and `mlflow ui --backend-store-uri
sqlite:///<run_dir>/mlflow.db` shows it. Set MLFLOW_TRACKING_URI (a server, or one database for
all runs) to compare runs side by side.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from meshtrain.config.trackers import MlflowConfig
from meshtrain.observe.trackers.run_info import RunInfo, flat_config

log = logging.getLogger(__name__)

DATABASE = "mlflow.db"
ARTIFACTS = "mlflow-artifacts"
# Not copied as artifacts: the checkpoints (gigabytes for a large model; checkpoint.dir holds
# them), MLflow's own store and W&B's offline run.
SKIPPED = ("checkpoints", DATABASE, f"{DATABASE}-journal", ARTIFACTS, "wandb")
_BATCH = 100  # params per request: MLflow's limit
_MAX_PARAM_CHARS = 6000  # MLflow's limit on a param's value
_UNSAFE = re.compile(r"[^\w./\- ]")  # characters MLflow refuses in a metric's name


def tracking_uri(
    settings: MlflowConfig, run_dir: Path, environ: Mapping[str, str] | None = None
) -> str:
    """logging.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else the run's own database."""
    environ = os.environ if environ is None else environ
    default = f"sqlite:///{Path(run_dir).absolute() / DATABASE}"
    return settings.tracking_uri or environ.get("MLFLOW_TRACKING_URI") or default


def experiment_name(
    settings: MlflowConfig, run: RunInfo, environ: Mapping[str, str] | None = None
) -> str:
    """logging.mlflow.experiment, else $MLFLOW_EXPERIMENT_NAME, else experiment.name."""
    environ = os.environ if environ is None else environ
    return settings.experiment or environ.get("MLFLOW_EXPERIMENT_NAME") or run.experiment


class MlflowTracker:
    """An MLflow run; its metrics under the names every tracker uses."""

    def __init__(self, settings: MlflowConfig, run: RunInfo) -> None:
        # MLflow and alembic log each step of creating a database at INFO on the console.
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._run_dir = Path(run.run_dir)
        uri = tracking_uri(settings, self._run_dir)
        self._client = MlflowClient(tracking_uri=uri)
        own_store = uri == tracking_uri(MlflowConfig(), self._run_dir, {})
        experiment_id = self._experiment(experiment_name(settings, run), own_store)
        created = self._client.create_run(
            experiment_id, run_name=run.name, tags={"meshtrain.run_dir": str(self._run_dir)}
        )
        self.run_id = created.info.run_id
        params = [Param(k, v[:_MAX_PARAM_CHARS]) for k, v in flat_config(run.config).items()]
        for start in range(0, len(params), _BATCH):
            self._client.log_batch(self.run_id, params=params[start : start + _BATCH])
        log.info("MLflow: run %s (%s) in %s", run.name, self.run_id, uri)

    def _experiment(self, name: str, own_store: bool) -> str:
        """The id of experiment `name`, created if new (its artifacts in the run directory
        when the store is the run's own)."""
        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = (self._run_dir / ARTIFACTS).absolute().as_uri() if own_store else None
        try:
            return self._client.create_experiment(name, artifact_location=location)
        except MlflowException:  # another run created it meanwhile
            return self._client.get_experiment_by_name(name).experiment_id

    def write(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [Metric(_UNSAFE.sub("_", tag), v, now, step) for tag, v in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self, *, failed: bool) -> None:
        """The run directory's files as artifacts (not its checkpoints, nor the trackers' own
        stores), then the run's end."""
        for path in sorted(self._run_dir.iterdir()):
            if path.name in SKIPPED:
                continue
            if path.is_dir():
                self._client.log_artifacts(self.run_id, str(path), artifact_path=path.name)
            else:
                self._client.log_artifact(self.run_id, str(path))
        self._client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
