"""LoRA adapters beside the projections: the math, the layout of the parameter tree, the random
draws, and the shardings A and B get on a mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.config import compose_config

from meshtrain.models.abstract import abstract_model, merge_model
from meshtrain.models.initialization import initial_params
from meshtrain.models.lora import (
    adapter_output,
    join_adapters,
    merge_adapters,
    merged_weight,
    split_adapters,
)
from meshtrain.parallel.mesh import build_mesh, parse_mesh_shape

LORA = ("model.lora.rank=4", "model.lora.alpha=8")


def _model(*overrides, mesh="[[1,1],[fsdp,tp]]"):
    cfg = compose_config(f"model.mesh_shape={mesh}", *overrides).model
    cfg = dataclasses.replace(cfg, scan_layers=False)
    devices = jax.devices()[: 1 if mesh.startswith("[[1,1]") else 8]
    spec = parse_mesh_shape(cfg.mesh_shape, len(devices), platform="cpu")
    mesh = build_mesh(spec, devices)
    return cfg, mesh, abstract_model(cfg, mesh, spec)


@pytest.mark.parametrize(
    ("equation", "x_shape", "w_shape"),
    [
        ("BTD,DNH->BTNH", (2, 3, 8), (8, 4, 5)),
        ("BTNH,NHD->BTD", (2, 3, 4, 5), (4, 5, 8)),
        ("BTF,FD->BTD", (2, 3, 6), (6, 8)),
    ],
)
def test_the_adapter_adds_x_a_b_scaled_as_a_merged_weight_would(equation, x_shape, w_shape):
    rng = np.random.default_rng(0)
    in_ndim = len(x_shape) - 2
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    a = jnp.asarray(rng.standard_normal((*w_shape[:in_ndim], 3)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((3, *w_shape[in_ndim:])), jnp.float32)
    with_adapter = jnp.einsum(equation, x, w) + adapter_output(equation, x, a, b, 0.5)
    merged = jnp.einsum(equation, x, merged_weight(w, a, b, 0.5))
    np.testing.assert_allclose(with_adapter, merged, rtol=1e-5, atol=1e-5)
    by_hand = x.reshape(6, -1) @ a.reshape(-1, 3) @ b.reshape(3, -1) * 0.5
    np.testing.assert_allclose(
        adapter_output(equation, x, a, b, 0.5).reshape(6, -1), by_hand, rtol=1e-5, atol=1e-5
    )


def test_adapters_sit_beside_their_weights_and_split_off_the_base():
    cfg, _, model = _model(*LORA, "model.lora.targets=[q,o,down]")
    adapters, base = split_adapters(model.abstract_params)
    block = adapters["blocks"][0]
    assert sorted(block["attn"]) == ["o_lora_a", "o_lora_b", "q_lora_a", "q_lora_b"]
    assert sorted(block["mlp"]) == ["down_lora_a", "down_lora_b"]
    d, n, h, f = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    assert block["attn"]["q_lora_a"].shape == (d, 4)
    assert block["attn"]["q_lora_b"].shape == (4, n, h)
    assert block["attn"]["o_lora_a"].shape == (n, h, 4)
    assert block["attn"]["o_lora_b"].shape == (4, d)
    assert block["mlp"]["down_lora_a"].shape == (f, 4)
    assert "embed" not in adapters and "q_lora_a" not in base["blocks"][0]["attn"]
    assert jax.tree.structure(join_adapters(adapters, base)) == jax.tree.structure(
        model.abstract_params
    )
    count = sum(a.size for a in jax.tree.leaves(adapters))
    assert count == cfg.num_layers * 4 * (d + n * h + n * h + d + f + d)


def test_a_and_b_are_sharded_like_the_weights_input_and_output():
    _, _, model = _model(*LORA, mesh="[[4,2],[fsdp,tp]]")
    attn = model.param_shardings["blocks"][0]["attn"]
    mlp = model.param_shardings["blocks"][0]["mlp"]
    assert tuple(attn["q"].spec) == ("fsdp", "tp", None)
    assert tuple(attn["q_lora_a"].spec) == ("fsdp", None)
    assert tuple(attn["q_lora_b"].spec) == (None, "tp", None)
    assert tuple(attn["o_lora_a"].spec) == ("tp", None, None)
    assert tuple(attn["o_lora_b"].spec) == (None, "fsdp")
    assert tuple(mlp["down_lora_a"].spec) == ("tp", None)
    assert tuple(mlp["gate_lora_b"].spec) == (None, "tp")


@pytest.mark.slow
def test_fresh_adapters_change_no_base_draw_and_no_logit():
    """B starts at zero and A draws from its own stream: the base holds the very values of the
    same seed without LoRA, and the logits are equal bit for bit."""
    plain_cfg, mesh, plain = _model()
    lora_cfg, _, lora = _model(*LORA)
    with jax.set_mesh(mesh):
        plain_params = initial_params(plain_cfg, 3, plain.param_shardings)
        lora_params = initial_params(lora_cfg, 3, lora.param_shardings)
        adapters, base = split_adapters(lora_params)
        for ours, theirs in zip(jax.tree.leaves(base), jax.tree.leaves(plain_params), strict=True):
            np.testing.assert_array_equal(ours, theirs)
        assert all(float(jnp.abs(b).max()) == 0 for b in _leaves_named(adapters, "_lora_b"))
        a = _leaves_named(adapters, "_lora_a")
        assert all(float(jnp.abs(x).max()) > 0 for x in a)
        assert len({float(x.ravel()[0]) for x in a}) == len(a)  # every A drawn anew
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 384, (2, 16)), jnp.int32)
        plain_logits = merge_model(plain, plain_params)(tokens)
        lora_logits = merge_model(lora, lora_params)(tokens)
    np.testing.assert_array_equal(np.asarray(lora_logits), np.asarray(plain_logits))


def test_adapter_a_is_uniform_within_one_over_sqrt_fan_in():
    cfg, mesh, model = _model(*LORA, "model.lora.targets=[o]", "model.num_layers=1")
    with jax.set_mesh(mesh):
        adapters = initial_params(
            cfg, 0, split_adapters(model.param_shardings)[0], adapters_only=True
        )
    a = np.asarray(adapters["blocks"][0]["attn"]["o_lora_a"])  # [N, H, r]: fan-in N·H
    bound = 1 / np.sqrt(cfg.num_heads * cfg.head_dim)
    assert a.min() >= -bound and a.max() <= bound
    assert a.max() > 0.9 * bound and a.min() < -0.9 * bound
    assert abs(a.mean()) < 0.1 * bound


def test_merging_folds_each_adapter_into_its_weight_and_drops_it():
    rng = np.random.default_rng(1)
    params = {
        "embed": np.ones((3, 2), np.float32),
        "blocks": {
            0: {
                "mlp": {
                    "up": rng.standard_normal((2, 5)).astype(np.float32),
                    "up_lora_a": rng.standard_normal((2, 3)).astype(np.float32),
                    "up_lora_b": rng.standard_normal((3, 5)).astype(np.float32),
                }
            }
        },
    }
    merged = merge_adapters(params, 0.25)
    mlp = params["blocks"][0]["mlp"]
    expected = mlp["up"] + 0.25 * mlp["up_lora_a"] @ mlp["up_lora_b"]
    np.testing.assert_allclose(merged["blocks"][0]["mlp"]["up"], expected, rtol=1e-6)
    assert sorted(merged["blocks"][0]["mlp"]) == ["up"]
    np.testing.assert_array_equal(merged["embed"], params["embed"])


def _leaves_named(tree, suffix):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [leaf for path, leaf in flat if str(path[-1].key).endswith(suffix)]
