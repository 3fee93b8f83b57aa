"""The MLflow tracker's settings: logging.mlflow first, then MLflow's own environment, then a
store in the run directory. (tests/observe/test_trackers.py runs it for real.)"""

from pathlib import Path

import pytest

mlflow_tracker = pytest.importorskip("meshtrain.observe.trackers.mlflow_tracker")
MlflowConfig = mlflow_tracker.MlflowConfig
RunInfo = mlflow_tracker.RunInfo


def test_the_store_is_the_key_else_mlflows_variable_else_the_run_directorys_database():
    run_dir = Path("/runs/tiny/x")
    env = {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}
    assert mlflow_tracker.tracking_uri(MlflowConfig(tracking_uri="file:///m"), run_dir, env) == (
        "file:///m"
    )
    assert mlflow_tracker.tracking_uri(MlflowConfig(), run_dir, env) == "http://mlflow:5000"
    assert mlflow_tracker.tracking_uri(MlflowConfig(), run_dir, {}) == (
        "sqlite:////runs/tiny/x/mlflow.db"
    )


def test_the_experiment_is_the_key_else_mlflows_variable_else_experiment_name():
    run = RunInfo(run_dir=Path("/runs/x"), name="tiny/x", experiment="tiny")
    env = {"MLFLOW_EXPERIMENT_NAME": "env"}
    assert mlflow_tracker.experiment_name(MlflowConfig(experiment="mine"), run, env) == "mine"
    assert mlflow_tracker.experiment_name(MlflowConfig(), run, env) == "env"
    assert mlflow_tracker.experiment_name(MlflowConfig(), run, {}) == "tiny"


def test_the_checkpoints_and_the_trackers_own_stores_are_no_artifacts():
    assert set(mlflow_tracker.SKIPPED) == {
        "checkpoints",
        "mlflow.db",
        "mlflow.db-journal",
        "mlflow-artifacts",
        "wandb",
    }
