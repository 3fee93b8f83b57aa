"""Faked CPU devices (plan.fake_devices): only before JAX starts."""

import re

import jax
import pytest
from helpers.process import run_python, subprocess_env

from meshtrain.distributed.devices import use_fake_cpu_devices
from meshtrain.distributed.xla_flags import CPU_COLLECTIVE_TIMEOUTS, with_cpu_collective_timeouts
from meshtrain.errors import ConfigError


def test_fake_devices_need_a_fresh_process():
    jax.devices()  # this process's backend has started (conftest fakes 8 devices)
    with pytest.raises(
        ConfigError, match=re.escape("plan.fake_devices=16 must be set before JAX starts")
    ):
        use_fake_cpu_devices(16)


@pytest.mark.parametrize(
    ("set_up", "devices"),
    [
        ("use_fake_cpu_devices(4)", 4),  # plan.fake_devices=4
        (
            "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=3'\n"
            "use_fake_cpu_devices(None)",
            3,
        ),  # the user's own XLA_FLAGS
    ],
)
def test_faked_devices_get_long_collective_timeouts(set_up, devices):
    """A fresh process, as run_training.py starts: XLA accepts the raised limits (it dies on an
    unknown flag) and the devices are faked; a limit the user set is kept."""
    env = subprocess_env(1)
    del env["XLA_FLAGS"]
    code = (
        "import os, jax\n"
        "from meshtrain.distributed.devices import use_fake_cpu_devices\n"
        f"{set_up}\n"
        "print(len(jax.devices()), os.environ['XLA_FLAGS'])\n"
    )
    result = run_python("-c", code, env=env)
    assert result.returncode == 0, result.stderr
    count, flags = result.stdout.split(" ", 1)
    assert int(count) == devices
    for name, value in CPU_COLLECTIVE_TIMEOUTS.items():
        assert f"--{name}={value}" in flags


def test_a_timeout_in_xla_flags_wins():
    flags = with_cpu_collective_timeouts("--xla_cpu_collective_call_terminate_timeout_seconds=9")
    assert flags.count("terminate_timeout") == 1 and "terminate_timeout_seconds=9" in flags
    assert flags.endswith("--xla_cpu_collective_timeout_seconds=86400")
