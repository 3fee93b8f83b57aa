"""logging.trackers: the names, and a missing package as one line naming the extra to install."""

from typing import get_args

import pytest

from meshtrain.config import trackers
from meshtrain.config.trackers import LoggingConfig, WandbConfig, check_logging
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
