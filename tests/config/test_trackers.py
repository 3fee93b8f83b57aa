"""logging.trackers: the names, a missing package as one line naming the extra to install, and
the W&B login and MLflow store checked before anything compiles."""

from pathlib import Path
from typing import get_args

import pytest

from meshtrain.config import trackers
from meshtrain.config.trackers import LoggingConfig, MlflowConfig, WandbConfig, check_logging
from meshtrain.errors import ConfigError


def test_tensorboard_alone_is_the_default_and_passes():
    assert LoggingConfig().trackers == ["tensorboard"]
    check_logging(LoggingConfig())
    check_logging(LoggingConfig(trackers=[]))


def test_an_unknown_tracker_names_the_known_ones():
    with pytest.raises(ConfigError) as err:
        check_logging(LoggingConfig(trackers=["tensorboard", "neptune"]))
    assert str(err.value) == (
        "logging.trackers: 'neptune' is not a tracker; use any of: tensorboard, wandb, mlflow "
        "(e.g. 'logging.trackers=[tensorboard,wandb]')"
    )


def test_a_tracker_named_twice_is_refused():
    with pytest.raises(ConfigError, match="names a tracker twice"):
        check_logging(LoggingConfig(trackers=["wandb", "wandb"]))


@pytest.mark.parametrize(("tracker", "module"), [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_package_is_one_line_naming_the_extra(tracker, module, monkeypatch):
    monkeypatch.setattr(
        trackers, "missing_package", lambda name: module if name == tracker else None
    )
    with pytest.raises(ConfigError) as err:
        check_logging(LoggingConfig(trackers=["tensorboard", tracker]))
    assert str(err.value) == (
        f"logging.trackers: {tracker} needs the {module} package, which is not installed; "
        f"pip install -e '.[trackers]' (or pip install {module}), or drop {tracker} from "
        "logging.trackers"
    )


def test_a_wandb_mode_must_be_one_of_wandbs():
    check_logging(LoggingConfig(trackers=[], wandb=WandbConfig(mode="offline")))
    with pytest.raises(ConfigError, match=r"logging.wandb.mode='local' is not supported"):
        check_logging(LoggingConfig(trackers=[], wandb=WandbConfig(mode="local")))


def test_the_package_lookup_imports_nothing():
    assert trackers.missing_package("tensorboard") is None  # tensorboardX: a core dependency
    assert set(trackers.TRACKER_PACKAGES) == set(get_args(trackers.Tracker))


def test_wandb_online_without_a_login_is_one_line_before_compiling(tmp_path, monkeypatch):
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine example.org login me password secret\n")
    netrc_file.chmod(0o600)
    bare = {"NETRC": str(netrc_file)}
    assert trackers.wandb_login_missing(WandbConfig(), bare) == "api.wandb.ai"
    assert trackers.wandb_login_missing(WandbConfig(mode="offline"), bare) is None
    assert trackers.wandb_login_missing(WandbConfig(), {**bare, "WANDB_MODE": "disabled"}) is None
    assert trackers.wandb_login_missing(WandbConfig(), {**bare, "WANDB_API_KEY": "k" * 40}) is None
    self_hosted = {**bare, "WANDB_BASE_URL": "https://example.org"}
    assert trackers.wandb_login_missing(WandbConfig(), self_hosted) is None  # its netrc entry
    # check_logging, as a run calls it before anything compiles (the package taken as installed).
    monkeypatch.setattr(trackers, "missing_package", lambda tracker: None)
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(netrc_file))
    with pytest.raises(ConfigError) as err:
        check_logging(LoggingConfig(trackers=["tensorboard", "wandb"]))
    assert str(err.value) == (
        "logging.trackers: wandb logs online but finds no login for api.wandb.ai (no "
        "WANDB_API_KEY, no entry in ~/.netrc); run `wandb login`, set WANDB_API_KEY, or log "
        "offline with logging.wandb.mode=offline (`wandb sync` uploads it later)"
    )
    check_logging(LoggingConfig(trackers=["wandb"], wandb=WandbConfig(mode="offline")))


def test_an_mlflow_store_it_could_not_open_is_one_line_before_compiling(tmp_path, monkeypatch):
    problem = trackers.mlflow_store_problem
    assert problem(MlflowConfig(), {}) is None  # the run's own database, in the run directory
    assert problem(MlflowConfig(tracking_uri="http://mlflow.example:5000"), {}) is None
    assert problem(MlflowConfig(), {"MLFLOW_TRACKING_URI": "databricks"}) is None
    new_dirs = f"sqlite:///{tmp_path}/a/b/mlflow.db"  # directories MLflow makes
    assert problem(MlflowConfig(tracking_uri=new_dirs), {}) is None
    for uri in (f"file://{tmp_path}/mlruns", "./mlruns"):
        assert problem(MlflowConfig(tracking_uri=uri), {}) == (
            f"logging.mlflow.tracking_uri={uri} is an MLflow file store, which MLflow refuses "
            "(maintenance mode); use a database such as sqlite:///<dir>/mlflow.db (or leave it "
            "unset: the run's own mlflow.db), or set MLFLOW_ALLOW_FILE_STORE=true to use the "
            "file store anyway"
        )
        assert problem(MlflowConfig(tracking_uri=uri), {"MLFLOW_ALLOW_FILE_STORE": "true"}) is None
    # A directory this process cannot write (simulated: the tests run as root, whom no file
    # mode stops), named by the variable that set it.
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = trackers.os.access
    monkeypatch.setattr(
        trackers.os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode)
    )
    uri = f"sqlite:///{locked}/sub/mlflow.db"
    assert problem(MlflowConfig(), {"MLFLOW_TRACKING_URI": uri}) == (
        f"MLFLOW_TRACKING_URI={uri}: {locked} is not writable, so MLflow cannot write its "
        "database; give a database in a writable directory (sqlite:///<dir>/mlflow.db), or "
        "leave it unset for the run's own mlflow.db"
    )
    # check_logging, as a run calls it before anything compiles (the package taken as installed).
    monkeypatch.setattr(trackers, "missing_package", lambda tracker: None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(ConfigError, match=r"^MLFLOW_TRACKING_URI=sqlite:.* is not writable"):
        check_logging(LoggingConfig(trackers=["mlflow"]))
    check_logging(LoggingConfig(trackers=["tensorboard"]))  # MLflow's settings not read
