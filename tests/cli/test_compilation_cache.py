"""What `python run_training.py` sets before JAX starts: the persistent compilation cache
(training.compilation_cache_dir) and, on GPU only, meshtrain's default XLA flags, never
overriding a flag the user set (training.xla_gpu_flags)."""

import os
import subprocess
import sys

import pytest
from helpers.config import CONFIG_DIR, compose_config
from hydra import compose, initialize_config_dir

from meshtrain.cli import train as cli
from meshtrain.cli.train import (
    DEFAULT_XLA_GPU_FLAGS,
    compilation_cache_dir,
    gpu_expected,
    merge_xla_flags,
)
from meshtrain.config.hydra import register_configs
from meshtrain.config.validate import check_config
from meshtrain.errors import ConfigError

LHS = "xla_gpu_enable_latency_hiding_scheduler"


def test_the_defaults_are_on():
    cfg = compose_config()
    assert cfg.training.compilation_cache_dir == "auto"
    assert cfg.data.cache_dir == "auto"
    assert cfg.training.xla_gpu_flags is True


def test_auto_is_the_jax_environment_variable_else_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path))
    assert compilation_cache_dir("auto", env_dir=None) == str(tmp_path / "jax")
    assert compilation_cache_dir("auto", env_dir="/elsewhere") == "/elsewhere"
    assert compilation_cache_dir("auto", env_dir=None, enabled=False) is None
    assert compilation_cache_dir("~/jc", env_dir="/elsewhere") == os.path.expanduser("~/jc")
    assert compilation_cache_dir(None, env_dir="/elsewhere") is None
    monkeypatch.delenv("MESHTRAIN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation_cache_dir("auto", env_dir=None) == str(tmp_path / "xdg/meshtrain/jax")


def test_an_empty_cache_directory_is_a_config_error():
    with pytest.raises(ConfigError, match=r"training\.compilation_cache_dir=''"):
        check_config(compose_config("training.compilation_cache_dir=''"))
    with pytest.raises(ConfigError, match=r"data\.cache_dir=''"):
        check_config(compose_config("data.cache_dir=''"))


def test_auto_fills_the_cache_root_from_the_first_compile(tmp_path):
    """In a fresh process with JAX's own variables unset, the first compile lands in
    <MESHTRAIN_CACHE_DIR>/jax, though it takes milliseconds (JAX alone caches compiles of 1 s
    or more)."""
    unset = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(MESHTRAIN_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    code = (
        "from meshtrain.cli.train import configure_compilation_cache as c; d = c('auto'); "
        "import jax; jax.jit(lambda x: x * 2 + 1)(1.0).block_until_ready(); print(d)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(tmp_path / "jax")
    assert any((tmp_path / "jax").iterdir())


def test_a_dry_run_for_a_gpu_this_host_lacks_caches_nothing(tmp_path):
    """plan.target: the programs compiled for the target never run here, and JAX cannot load
    them back without its client (a warning at every later dry run): the cache is off, even
    where $JAX_COMPILATION_CACHE_DIR turns JAX's own on."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"), "JAX_PLATFORMS": "cpu"}
    code = (
        "from meshtrain.cli.train import configure_compilation_cache as c; "
        "d = c('auto', deviceless=True); import jax; "
        "jax.jit(lambda x: x * 2 + 1)(1.0).block_until_ready(); "
        "print(d, jax.config.jax_enable_compilation_cache)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["None", "False"]
    assert not (tmp_path / "jax").exists() or not any((tmp_path / "jax").iterdir())


def test_the_cli_configures_both_before_jax_is_used(monkeypatch):
    """train_from_hydra sets the flags and the cache from the config before it joins the run
    (the first thing that touches a device)."""
    calls = []
    monkeypatch.setattr(
        cli,
        "configure_xla_gpu_flags",
        lambda on, gpu_target: calls.append(("flags", on, gpu_target)),
    )
    monkeypatch.setattr(
        cli,
        "configure_compilation_cache",
        lambda d, deviceless: calls.append(("cache", d, deviceless)),
    )
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["training.compilation_cache_dir=/tmp/x", "training.xla_gpu_flags=false"],
        )
    with pytest.raises(ValueError, match="HydraConfig"):  # the run directory comes next
        cli.train_from_hydra(cfg)
    assert calls == [("flags", False, False), ("cache", "/tmp/x", False)]


def test_defaults_are_appended_for_flags_the_user_did_not_set():
    merged = merge_xla_flags("", DEFAULT_XLA_GPU_FLAGS)
    assert merged.split() == [f"--{k}={v}" for k, v in DEFAULT_XLA_GPU_FLAGS.items()]
    assert f"--{LHS}=true" in merged


def test_a_flag_the_user_set_wins():
    mine = f"--xla_dump_to=/tmp/dump --{LHS}=false --xla_gpu_all_gather_combine_threshold_bytes=1"
    merged = merge_xla_flags(mine, DEFAULT_XLA_GPU_FLAGS)
    assert merged.startswith(mine)
    assert merged.count(LHS) == 1 and f"--{LHS}=false" in merged
    assert merged.count("xla_gpu_all_gather_combine_threshold_bytes") == 1
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=" in merged
    # A bare boolean flag and a single dash count as set too.
    assert LHS not in merge_xla_flags(f"--{LHS}", DEFAULT_XLA_GPU_FLAGS).replace(f"--{LHS}", "", 1)
    assert merge_xla_flags(f"-{LHS}=false", DEFAULT_XLA_GPU_FLAGS).count(LHS) == 1
    everything = " ".join(f"--{k}=0" for k in DEFAULT_XLA_GPU_FLAGS)
    assert merge_xla_flags(everything, DEFAULT_XLA_GPU_FLAGS) == everything


def test_gpu_is_expected_only_where_jax_will_pick_one(monkeypatch):
    assert not gpu_expected("cpu")
    assert gpu_expected("cuda") and gpu_expected("cuda,cpu") and gpu_expected("rocm")
    assert not gpu_expected("tpu")
    monkeypatch.setattr(cli, "_gpu_plugin_installed", lambda: True)
    monkeypatch.setattr(cli, "gpu_present", lambda: True)
    assert gpu_expected(None) and gpu_expected("")
    monkeypatch.setattr(cli, "gpu_present", lambda: False)  # the plugin, but no GPU
    assert not gpu_expected(None)
    monkeypatch.setattr(cli, "_gpu_plugin_installed", lambda: False)
    assert not gpu_expected(None)


def test_flags_are_set_on_gpu_only_and_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--{LHS}=false")
    assert cli.configure_xla_gpu_flags(True) == []  # the tests run on JAX_PLATFORMS=cpu
    assert os.environ["XLA_FLAGS"] == f"--{LHS}=false"
    monkeypatch.setattr(cli, "gpu_expected", lambda platforms: True)
    assert cli.configure_xla_gpu_flags(False) == []
    added = cli.configure_xla_gpu_flags(True)
    assert len(added) == len(DEFAULT_XLA_GPU_FLAGS) - 1 and not any(LHS in a for a in added)
    assert os.environ["XLA_FLAGS"] == f"--{LHS}=false " + " ".join(added)


def test_flags_are_set_when_compiling_for_a_gpu_target_from_a_cpu(monkeypatch):
    """plan.target: JAX runs on this host's CPU, and the GPU program gets the GPU flags."""
    monkeypatch.setenv("XLA_FLAGS", "")
    assert cli.configure_xla_gpu_flags(True) == []  # the tests run on JAX_PLATFORMS=cpu
    added = cli.configure_xla_gpu_flags(True, gpu_target=True)
    assert added == [f"--{k}={v}" for k, v in DEFAULT_XLA_GPU_FLAGS.items()]
