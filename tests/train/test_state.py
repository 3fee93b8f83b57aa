"""The train state's initialisation programs: compiled at a low optimisation level on CPU."""

import jax
import optax
from helpers.config import compose_config

from meshtrain.train.setup import prepare
from meshtrain.train.state import init_compiler_options, state_shardings


def test_init_compiles_at_level_1_on_cpu_or_lower_where_xla_flags_say(monkeypatch):
    setup = prepare(compose_config("data=synthetic"), jax.devices()[:1], with_data=False)
    shardings = state_shardings(setup.model, optax.adamw(1e-3), setup.mesh)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert init_compiler_options(shardings) == {"xla_backend_optimization_level": 1}
    # The tests' fast compiles (tests/helpers/process.py) ask for 0 in XLA_FLAGS: a per-compile
    # option would override it, so the lower level is kept.
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_foo=1")
    assert init_compiler_options(shardings) == {"xla_backend_optimization_level": 0}
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
    assert init_compiler_options(shardings) == {"xla_backend_optimization_level": 1}
