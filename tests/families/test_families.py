"""The family registry and the block vocabulary (meshtrain.families): lookups, their one-line
errors, and the vocabulary's widths, axes and layouts agreeing with the model's parameters."""

from __future__ import annotations

import dataclasses
import math

import pytest
from flax import nnx

from meshtrain.config import ModelConfig
from meshtrain.config.moe import MoeConfig
from meshtrain.errors import ConfigError
from meshtrain.families import REGISTERED, family, family_of_model_type
from meshtrain.families.vocabulary import DENSE_BLOCK, PROJECTION_NAMES, block_norms
from meshtrain.models.transformer import Transformer

CFG = ModelConfig(d_model=48, num_heads=6, num_kv_heads=2, head_dim=8, mlp_dim=80, num_layers=1)


def test_an_unknown_family_is_refused_in_one_line_naming_the_registered_ones():
    with pytest.raises(ConfigError) as error:
        family("lama")
    assert str(error.value) == (
        "model.family='lama' is not supported; use one of: llama, qwen3, gemma3, qwen3_moe, "
        "mixtral (did you mean 'llama'?)"
    )


def test_a_model_type_is_read_by_its_family_and_a_multimodal_one_by_its_text_family():
    assert family_of_model_type("gemma3_text", "x").name == "gemma3"
    assert family_of_model_type("gemma3", "x").name == "gemma3"
    with pytest.raises(ConfigError, match=r"^c/config.json: model_type 'mistral' is not supported"):
        family_of_model_type("mistral", "c/config.json")


def test_the_dense_block_costs_the_flops_of_its_matmuls():
    per_token = sum(p.flops_per_token(CFG) for p in DENSE_BLOCK)
    attention = 2 * 48 * 8 * (2 * 6 + 2 * 2)  # q, o [D, N·H]; k, v [D, K·H]
    assert per_token == attention + 2 * 3 * 48 * 80
    assert tuple(p.name for p in DENSE_BLOCK) == PROJECTION_NAMES


@pytest.mark.parametrize("name", list(REGISTERED))
def test_each_weight_of_a_block_is_in_the_vocabulary_with_the_axes_and_widths_it_has(name):
    spec = REGISTERED[name]
    experts = MoeConfig(num_experts=4, top_k=2, expert_dim=24) if spec.mixture_of_experts else None
    cfg = dataclasses.replace(CFG, family=name, moe=experts or MoeConfig(), **spec.features)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    block = {
        path[2:]: variable
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if path[0] == "blocks"
    }
    declared = {p.path for p in spec.projections} | {n.path for n in block_norms(cfg)}
    assert set(block) == declared
    for projection in spec.projections:
        weight = block[projection.path]
        assert weight.get_metadata()["logical_axes"] == projection.axes
        layout = getattr(projection.layout, "inner", projection.layout)  # PerExpert's
        assert len(layout.perm) == len(projection.axes) - projection.leading
        width_in, width_out = projection.widths(cfg)
        copies = weight.shape[: projection.leading]  # experts
        inputs = weight.shape[projection.leading :][: projection.inputs]
        assert (width_in * width_out, width_in) == (
            weight.size // math.prod(copies),
            math.prod(inputs),
        )


def test_a_mixture_of_experts_costs_its_router_and_its_active_experts():
    cfg = dataclasses.replace(
        CFG, family="qwen3_moe", qk_norm=True, moe=MoeConfig(num_experts=8, top_k=3, expert_dim=24)
    )
    per_token = sum(p.flops_per_token(cfg) for p in family("qwen3_moe").projections)
    attention = 2 * 48 * 8 * (2 * 6 + 2 * 2)
    assert per_token == attention + 2 * 48 * 8 + 3 * 2 * 3 * 48 * 24
