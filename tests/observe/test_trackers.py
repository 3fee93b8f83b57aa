"""The experiment trackers: their shared names and run name, and a real run that logs to
TensorBoard, W&B (offline) and MLflow (its SQLite store in the run directory) at once, each
holding every logged step's metrics with the values of metrics.jsonl."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers.runs import SMALL_RUN, train_tiny

from meshtrain.config.trackers import LoggingConfig
from meshtrain.errors import ConfigError
from meshtrain.observe import trackers
from meshtrain.observe.trackers.run_info import RunInfo, flat_config, metric_tag, run_name
from meshtrain.observe.trackers.tensorboard import config_table


def test_every_tracker_names_a_metric_as_tensorboard_does():
    assert metric_tag("loss") == "train/loss"
    assert metric_tag("data_share/web") == "train/data_share/web"
    assert metric_tag("val_loss") == "val/loss"
    assert metric_tag("val_perplexity") == "val/perplexity"


@pytest.mark.parametrize(
    ("run_dir", "name"),
    [
        ("/home/me/meshtrain/outputs/tiny/2026-01-31/12-00-00", "tiny/2026-01-31/12-00-00"),
        ("outputs/tiny_fsdp/2026-01-31/12-00-00", "tiny_fsdp/2026-01-31/12-00-00"),
        ("/x/multirun/tiny/2026-01-31/12-00-00/3", "tiny/2026-01-31/12-00-00/3"),
        ("/tmp/runs/demo", "tiny/demo"),  # hydra.run.dir elsewhere
    ],
)
def test_the_run_is_named_as_tensorboard_names_it_under_outputs(run_dir, name):
    assert run_name(Path(run_dir), "tiny") == name


def test_the_config_flattens_to_text_keys_mlflow_accepts():
    config = {
        "training": {"steps": 3, "learning_rate": 0.003},
        "model": {"mesh_shape": [[1, 1], ["fsdp", "tp"]], "init_from": None, "name": "tiny"},
        "data": {"mixture": [{"name": "a", "weight": 0.5}]},
    }
    assert flat_config(config) == {
        "training.steps": "3",
        "training.learning_rate": "0.003",
        "model.mesh_shape": '[[1, 1], ["fsdp", "tp"]]',
        "model.init_from": "null",
        "model.name": "tiny",
        "data.mixture.0.name": "a",
        "data.mixture.0.weight": "0.5",
    }
    assert config_table({"training": {"steps": 3}}).splitlines() == [
        "| key | value |",
        "|---|---|",
        "| `training.steps` | `3` |",
    ]


class _Fake:
    def __init__(self, name: str, closed: list[str], *, fail_open: bool = False) -> None:
        if fail_open:
            raise RuntimeError(f"{name} cannot open")
        self.name, self.closed = name, closed

    def write(self, step, values):
        pass

    def close(self, *, failed: bool) -> None:
        self.closed.append(f"{self.name} failed={failed}")


def test_a_tracker_that_fails_to_open_closes_those_opened_before(monkeypatch, tmp_path):
    closed: list[str] = []
    monkeypatch.setattr(
        trackers,
        "_OPENERS",
        {
            "tensorboard": lambda s, r: _Fake("tensorboard", closed),
            "wandb": lambda s, r: _Fake("wandb", closed),
            "mlflow": lambda s, r: _Fake("mlflow", closed, fail_open=True),
        },
    )
    run = RunInfo(run_dir=tmp_path, name="tiny/x", experiment="tiny")
    with pytest.raises(ConfigError) as err:
        trackers.open_trackers(LoggingConfig(trackers=["tensorboard", "wandb", "mlflow"]), run)
    assert str(err.value) == (
        "logging.trackers: mlflow could not start its run (RuntimeError: mlflow cannot open); "
        "fix logging.mlflow's settings, or drop mlflow from logging.trackers "
        "(MESHTRAIN_DEBUG=1 shows the traceback)"
    )
    assert isinstance(err.value.__cause__, RuntimeError)
    assert closed == ["tensorboard failed=True", "wandb failed=True"]


@pytest.fixture
def offline_trackers(monkeypatch, tmp_path):
    """W&B offline with its settings and caches under tmp_path, MLflow's default store."""
    wandb = pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    for name in (
        "WANDB_PROJECT",
        "WANDB_ENTITY",
        "WANDB_DIR",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
    ):
        monkeypatch.delenv(name, raising=False)
    yield
    wandb.teardown()  # W&B's service process ends with this test
    root = logging.getLogger("meshtrain")  # setup_logging's handlers hold this test's files
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.propagate = True


def assert_every_tracker_holds_the_jsonl(run_dir: Path, name: str, status: str) -> dict:
    """W&B's offline run and MLflow's database hold every step of metrics.jsonl, each metric
    under its TensorBoard name with the same float, the run's name and its config; returns the
    MLflow run's params."""
    from helpers.wandb_records import history, offline_run_file, run_record
    from mlflow.tracking import MlflowClient

    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = {r["step"]: {metric_tag(k): v for k, v in r.items() if k != "step"} for r in logged}

    # W&B: the offline run's records, as `wandb sync` would upload them.
    run_file = offline_run_file(run_dir)
    assert history(run_file) == want  # every step, every metric, the same float
    record = run_record(run_file)
    assert (record.display_name, record.project) == (name, "meshtrain")
    config = {item.key: json.loads(item.value_json) for item in record.config.update}
    assert config["training"]["steps"] == 3 and config["data"]["source"] == "synthetic"

    # MLflow: the run directory's own database, read with MLflow's client.
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert (run.info.run_name, run.info.status) == (name, status)
    for tag in {tag for values in want.values() for tag in values}:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
        assert got == {step: values[tag] for step, values in want.items() if tag in values}, tag
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"metrics.jsonl", "train.log"} <= artifacts
    assert not artifacts & {"checkpoints", "mlflow.db", "mlflow-artifacts", "wandb"}, artifacts
    assert any(name.startswith("events.out.tfevents") for name in artifacts)
    return run.data.params


def test_the_writer_logs_every_step_to_every_tracker_and_marks_a_failed_run(
    offline_trackers, tmp_path
):
    """MetricsWriter with a run's config: the three trackers opened, three steps written (a
    training run's metrics), then the run fails; each tracker's run is marked failed."""
    from helpers.config import compose_config
    from helpers.wandb_records import offline_run_file, records

    from meshtrain.observe.metrics import MetricsWriter, setup_logging

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").mkdir()  # not an artifact
    config = compose_config(*SMALL_RUN, "logging.trackers=[tensorboard,wandb,mlflow]")
    setup_logging(run_dir, is_main=True)
    steps = {
        1: {"loss": 5.982412338256836, "learning_rate": 0.003, "grad_norm": 0.8512},
        2: {"loss": 5.98, "learning_rate": 0.003, "data_share/web": 0.25},
        3: {"loss": 5.968, "val_loss": 5.9789, "val_perplexity": 395.0312},
    }
    with (
        pytest.raises(RuntimeError, match="the step failed"),
        MetricsWriter(run_dir, total_steps=3, is_main=True, config=config) as writer,
    ):
        for step, values in steps.items():
            writer.write(step, values)
        raise RuntimeError("the step failed")
    params = assert_every_tracker_holds_the_jsonl(run_dir, "tiny/run", "FAILED")
    (ended,) = [r.exit for r in records(offline_run_file(run_dir)) if r.HasField("exit")]
    assert ended.exit_code == 1
    assert params["training.steps"] == "3"
    assert params["model.mesh_shape"] == '[[1, 1], ["fsdp", "tp"]]'
    assert params["logging.trackers"] == '["tensorboard", "wandb", "mlflow"]'


@pytest.mark.slow
def test_a_training_run_logs_the_same_metrics_to_every_tracker(offline_trackers, tmp_path):
    """train() with the three trackers (about 10 s on 2 cores: MLflow's import and database
    take 3 s): every logged step, the evaluation's too, in W&B and MLflow as in metrics.jsonl."""
    run_dir = tmp_path / "run"
    overrides = (*SMALL_RUN, "training.eval_every=3")
    train_tiny(run_dir, *overrides, "logging.trackers=[tensorboard,wandb,mlflow]", devices=1)
    logged = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in logged] == [1, 2, 3]
    assert "val_loss" in json.loads(logged[-1])
    assert_every_tracker_holds_the_jsonl(run_dir, "tiny/run", "FINISHED")
