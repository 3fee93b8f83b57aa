"""Test set-up: 8 faked CPU devices, set before JAX starts, and helpers to compose real configs."""

import os

# Must happen before jax initialises its backend (i.e. before any test imports jax).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from meshtrain.config import Config, register_configs, to_config

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "configs"


def compose_config(*overrides: str) -> Config:
    """The typed config `python run_training.py <overrides>` would run with."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def subprocess_env(num_devices: int = 8) -> dict[str, str]:
    """Environment for a child `python run_training.py`: its own faked device count."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path
