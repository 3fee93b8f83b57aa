"""Logical rules → PartitionSpecs, parameters born sharded, bytes per device, activation constraints."""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_hf
from helpers.config import compose_config
from jax.sharding import PartitionSpec as P

from meshtrain.config.schema import DEFAULT_LOGICAL_AXIS_RULES
from meshtrain.errors import ConfigError
from meshtrain.models.abstract import abstract_model
from meshtrain.models.transformer import _compiled_call
from meshtrain.parallel.mesh import build_mesh, parse_mesh_shape
from meshtrain.parallel.rules import check_rules, logical_to_spec
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.state import create_train_state, state_shardings
from meshtrain.weights.load import load_hf

RULES = DEFAULT_LOGICAL_AXIS_RULES


def test_logical_to_spec_megatron_layout():
    # The model dimension on fsdp and cp (context parallelism shards weights as fsdp does).
    fsdp_cp = ("fsdp", "cp")
    assert logical_to_spec(("embed", "heads", "head_dim"), RULES) == P(fsdp_cp, "tp", None)
    assert logical_to_spec(("mlp", "embed"), RULES) == P("tp", fsdp_cp)
    assert logical_to_spec(("vocab", "embed"), RULES) == P("tp", fsdp_cp)
    assert logical_to_spec(("batch", "length", None), RULES) == P(("dp", "fsdp", "ep"), "cp", None)
    assert logical_to_spec(("norm",), RULES) == P(None)
    # A mixture of experts' experts on ep, one expert's hidden width on tp.
    expert = ("experts", "embed", "expert_mlp")
    assert logical_to_spec(expert, RULES) == P("ep", fsdp_cp, "tp")
    assert logical_to_spec((None, "batch", None), RULES) == P(None, ("dp", "fsdp", "ep"), None)


def test_a_mesh_axis_shards_one_dimension_only():
    rules = {"a": "fsdp", "b": ["fsdp", "tp"]}
    assert logical_to_spec(("a", "b"), rules) == P("fsdp", "tp")


def test_rules_errors():
    with pytest.raises(
        ConfigError, match=r"model.logical_axis_rules.mlp='model' names unknown mesh axis 'model'"
    ):
        check_rules({**RULES, "mlp": "model"})
    with pytest.raises(ConfigError, match="has no rule for logical axis 'mlp'"):
        logical_to_spec(("mlp",), {})


EXPECTED_SPECS = {
    "embed": P("tp", "fsdp"),
    "blocks.0.attn.q": P("fsdp", "tp", None),
    "blocks.0.attn.k": P("fsdp", "tp", None),
    "blocks.0.attn.v": P("fsdp", "tp", None),
    "blocks.0.attn.o": P("tp", None, "fsdp"),
    "blocks.0.mlp.gate": P("fsdp", "tp"),
    "blocks.0.mlp.up": P("fsdp", "tp"),
    "blocks.0.mlp.down": P("tp", "fsdp"),
    "blocks.0.attn_norm.scale": P(None),
    "final_norm.scale": P(None),
}


@pytest.fixture(scope="module")
def sharded_state():
    cfg = compose_config("model.mesh_shape=[[4,2],[fsdp,tp]]")
    spec = parse_mesh_shape(cfg.model.mesh_shape, 8)
    mesh = build_mesh(spec)
    model = abstract_model(cfg.model, mesh, spec)
    tx = build_optimizer(cfg.training)
    shardings = state_shardings(model, tx, mesh)
    with jax.set_mesh(mesh):
        state = create_train_state(cfg.model, tx, shardings, seed=0)
    return state


def _by_name(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="."): leaf for path, leaf in flat}


def test_parameters_follow_the_rules(sharded_state):
    params = _by_name(sharded_state.params)
    for name, spec in EXPECTED_SPECS.items():
        assert params[name].sharding.spec == spec, name


def test_bytes_per_device_equal_total_over_shards(sharded_state):
    for name, array in _by_name(sharded_state.params).items():
        spec = array.sharding.spec
        shards = math.prod(
            array.sharding.mesh.shape[a]
            for entry in spec
            if entry is not None
            for a in ((entry,) if isinstance(entry, str) else entry)
        )
        per_device = {s.device: s.data.nbytes for s in array.addressable_shards}
        assert len(per_device) == 8
        assert set(per_device.values()) == {array.nbytes // shards}, name


def test_adam_moments_are_sharded_like_their_parameters(sharded_state):
    params = _by_name(sharded_state.params)
    moments = [s for s in jax.tree.leaves(sharded_state.opt_state) if getattr(s, "ndim", 0) >= 1]
    assert len(moments) == 2 * len(params)  # mu and nu per parameter
    mu_q = _by_name(sharded_state.opt_state)
    q_moments = [v for k, v in mu_q.items() if k.endswith("blocks.0.attn.q")]
    assert len(q_moments) == 2
    assert all(m.sharding.spec == P("fsdp", "tp", None) for m in q_moments)


def test_init_does_not_depend_on_the_mesh(sharded_state):
    cfg = compose_config()
    spec = parse_mesh_shape(cfg.model.mesh_shape, 1)
    mesh = build_mesh(spec, jax.devices()[:1])
    model = abstract_model(cfg.model, mesh, spec)
    tx = build_optimizer(cfg.training)
    with jax.set_mesh(mesh):
        single = create_train_state(cfg.model, tx, state_shardings(model, tx, mesh), seed=0)
    for name, array in _by_name(single.params).items():
        np.testing.assert_array_equal(
            np.asarray(array), np.asarray(_by_name(sharded_state.params)[name])
        )


@pytest.mark.slow
def test_a_batch_the_mesh_does_not_divide_is_not_padded_onto_every_device(tmp_path):
    # One sequence on fsdp=8: constraining its batch dimension over fsdp would pad it to one row
    # per device, each computing the whole sequence (7.1× one device's temporaries, and the
    # 22 GiB that gemma3_270m's rehearsal needed); left to XLA, a device needs at most as much
    # as one device running it alone, and the logits are the same.
    directory = tiny_hf.write_checkpoint("gemma3", tmp_path / "gemma3")
    tokens = jnp.asarray(np.arange(64, dtype=np.int32)[None] % 97)
    temporaries, logits = {}, {}
    for mesh in (None, [[8, 1], ["fsdp", "tp"]]):
        model = load_hf(directory, mesh)
        sharding = jax.tree.leaves(nnx.state(model, nnx.Param))[0].sharding
        # The model's own compiled call (Transformer.__call__ outside a trace), which model(tokens)
        # below then runs without compiling it again.
        with jax.set_mesh(sharding.mesh) if mesh else contextlib.nullcontext():
            compiled = _compiled_call.lower(model, tokens, None, None).compile()
        temporaries[str(mesh)] = compiled.memory_analysis().temp_size_in_bytes
        logits[str(mesh)] = np.asarray(model(tokens))
    one, eight = temporaries.values()
    assert eight <= one, temporaries
    np.testing.assert_allclose(*logits.values(), rtol=1e-5, atol=1e-5)
