"""Faked CPU devices (plan.fake_devices): plan a large mesh on a laptop; set before JAX starts."""

from __future__ import annotations

import os

import jax

from meshtrain.errors import ConfigError


def use_fake_cpu_devices(count: int | None) -> None:
    """Makes JAX see `count` CPU devices (plan.fake_devices); must run before JAX starts."""
    if count is None:
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        raise ConfigError(
            f"plan.fake_devices={count} must be set before JAX starts; "
            "pass it on the command line of run_training.py"
        ) from None
