"""Faked CPU devices (plan.fake_devices): plan a large mesh on a laptop; set before JAX starts."""

from __future__ import annotations

import os

import jax

from meshtrain.distributed.xla_flags import FAKE_DEVICE_COUNT, raise_cpu_collective_timeouts
from meshtrain.errors import ConfigError


def use_fake_cpu_devices(count: int | None) -> None:
    """Makes JAX see `count` CPU devices (plan.fake_devices); must run before JAX starts. With
    faked devices (these, or XLA_FLAGS=--xla_force_host_platform_device_count=N), XLA's CPU
    collective timeouts are raised (distributed.xla_flags)."""
    if count is None:
        if FAKE_DEVICE_COUNT.search(os.environ.get("XLA_FLAGS", "")):
            raise_cpu_collective_timeouts()
        return
    raise_cpu_collective_timeouts()
    use_cpu(f"plan.fake_devices={count}", devices=count)


def compile_here_for(target: str | None) -> None:
    """plan.target: this host's CPU compiles for GPUs it lacks (meshtrain.hardware), so JAX must
    not look for a GPU of its own (the CUDA plugin the compile needs would fail to start
    without one). Must run before JAX starts."""
    if target is not None:
        use_cpu(f"plan.target={target}")


def use_cpu(setting: str, devices: int | None = None) -> None:
    """Makes JAX run on the CPU (as `devices` CPU devices, if given), for `setting`
    ("plan.target=h100"); must run before JAX starts its backend, else a ConfigError naming
    `setting`."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        jax.config.update("jax_platforms", "cpu")
        if devices is not None:
            jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:
        raise ConfigError(
            f"{setting} must be set before JAX starts; "
            "pass it on the command line of run_training.py"
        ) from None
