"""Test set-up: 8 faked CPU devices, set before JAX starts, and helpers to compose real configs."""
# ruff: noqa: E402  (the environment must be set before anything imports jax)

import atexit
import os
import shutil
import tempfile

# The tests compile far more than they compute: without XLA's expensive CPU optimisations the
# compiles take half the time (the losses agree to the digits the docs print). Both sides of
# every comparison run with the same flags.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

# Must happen before jax initialises its backend (i.e. before any test imports jax).
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE} --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most test launches compile the same few small programs: a compilation cache shared by this
# session's processes (and inherited by the subprocesses) compiles each of them once. A fresh
# directory per session, so nothing carries over from one session to the next.
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="meshtrain-test-jax-cache-")
atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILATION_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from meshtrain.config import Config
from meshtrain.config.hydra import register_configs, to_config

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
    env["XLA_FLAGS"] = f"{FAST_COMPILE} --xla_force_host_platform_device_count={num_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path
