"""The random initial parameters come from two block-sized programs, with exactly the values
the whole model's constructor draws, born in their shardings, whatever the depth."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from helpers.config import compose_config

from meshtrain.models.initialization import (
    draws_per_block,
    first_draws,
    initial_params,
    initial_params_programs,
)
from meshtrain.models.transformer import Transformer
from meshtrain.observe.hlo import parse_module
from meshtrain.train.setup import prepare

GEMMA_LIKE = (
    "model.attention_pattern=[local,global]",
    "model.sliding_window=8",
    "model.qk_norm=true",
    "model.post_norms=true",
    "model.tie_embeddings=false",
)
CASES = {
    "llama-like, 1 device": (),
    "scanned, 8 devices (fsdp 4 x tp 2)": (
        "model.scan_layers=true",
        "model.mesh_shape=[[4,2],[fsdp,tp]]",
    ),
    "gemma-like (untied head), 4 devices": (*GEMMA_LIKE, "model.mesh_shape=[[2,2],[fsdp,tp]]"),
    "gemma-like scanned over pp=2": (
        *GEMMA_LIKE,
        "model.num_layers=4",
        "model.mesh_shape=[[2,2],[pp,fsdp]]",
    ),
}


def _setup(*overrides):
    cfg = compose_config("data=synthetic", *overrides)
    devices = int(np.prod(cfg.model.mesh_shape[0]))
    return prepare(cfg, jax.devices()[:devices], with_data=False)


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_values_as_the_whole_model_in_its_shardings(case):
    """Bit for bit the values of Transformer(cfg, rngs=nnx.Rngs(seed)), the same tree, and
    each leaf in the sharding the run gives it."""
    setup = _setup(*CASES[case])
    cfg, shardings = setup.cfg.model, setup.model.param_shardings
    with jax.set_mesh(setup.mesh):
        ours = initial_params(cfg, 3, shardings)
    # The constructor itself, op by op on one device: its small programs are shared by the
    # cases, where one jit of the whole constructor per case compiles a whole model's draws.
    whole = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(3)), nnx.Param))
    assert jax.tree.structure(ours) == jax.tree.structure(whole)
    for a, b, sharding in zip(
        jax.tree.leaves(ours), jax.tree.leaves(whole), jax.tree.leaves(shardings), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == sharding


def test_draw_order_of_a_block():
    """Seven random draws per block (q, k, v, o, gate, up, down: norms start constant); the
    blocks follow the embedding's draw 0 and precede an untied head's. LoRA's A matrices draw
    from their own stream (one per adapter): the base's draws stay where they were."""
    cfg = compose_config().model
    assert draws_per_block(cfg) == (7, 0)
    assert first_draws(dataclasses.replace(cfg, num_layers=3)).tolist() == [[1, 0], [8, 0], [15, 0]]
    lora = compose_config("model.lora.rank=4", "model.lora.targets=[q,v,down]").model
    assert draws_per_block(lora) == (7, 3)
    assert first_draws(dataclasses.replace(lora, num_layers=3)).tolist() == [
        [1, 0],
        [8, 3],
        [15, 6],
    ]


@pytest.mark.slow  # compiles four initialisations
@pytest.mark.parametrize("scan", [False, True])
def test_the_programs_do_not_grow_with_depth(scan):
    """The outer and block programs of a 2-layer and a 12-layer model have the same number of
    instructions (the depth is a loop over runs, or a vmapped axis): what compiles in seconds
    for a few layers does for Gemma 3's 26 or Llama 3 8B's 32."""

    def sizes(layers):
        setup = _setup(f"model.num_layers={layers}", f"model.scan_layers={str(scan).lower()}")
        with jax.set_mesh(setup.mesh):
            programs = initial_params_programs(setup.cfg.model, 0, setup.model.param_shardings)
            modules = [parse_module(p.compile().as_text()) for p in programs]
        return [sum(len(c) for c in m.computations.values()) for m in modules]

    assert sizes(2) == sizes(12)
