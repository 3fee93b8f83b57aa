"""Faked CPU devices (plan.fake_devices): only before JAX starts."""

import re

import jax
import pytest

from meshtrain.distributed.devices import use_fake_cpu_devices
from meshtrain.errors import ConfigError


def test_fake_devices_need_a_fresh_process():
    jax.devices()  # this process's backend has started (conftest fakes 8 devices)
    with pytest.raises(
        ConfigError, match=re.escape("plan.fake_devices=16 must be set before JAX starts")
    ):
        use_fake_cpu_devices(16)
