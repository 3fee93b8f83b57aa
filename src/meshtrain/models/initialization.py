"""The model's random initial parameters, from programs the size of one block.

`Transformer(cfg, rngs=nnx.Rngs(seed))` draws its n-th random parameter from
jax.random.fold_in(jax.random.key(seed), n): the embedding (n = 0), then each block's draws in
order, then the untied output head. Built as one program, XLA fuses the draws of all layers
together: on GPU its multi-output fusion merged Gemma 3 1B's 26 layers into kernels of up to 52
outputs, one of which took 7 minutes to compile (docs/performance.md). The same values come here
from two small programs instead, whatever the depth:

    outer   the embedding, the final norm and the output head (a Transformer of no layers);
    block   one block's parameters from the index of its first draw, an argument: compiled once
            and run once per layer, or vmapped over the layers into scan_layers' stacked arrays.

Each is compiled with the parameters' shardings as its out shardings, so weights are born
sharded, and the random values do not depend on the mesh (jax's partitionable threefry).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from meshtrain.config.schema import ModelConfig
from meshtrain.models.transformer import Block, Transformer


class DrawKeys:
    """Stands in for nnx.Rngs(seed) while parameters are built: the n-th call of `params()`
    returns the key nnx.Rngs(seed).params() returns at its draw `index(n)` (default: n)."""

    def __init__(self, seed: int, index: Callable[[int], Any] = lambda n: n) -> None:
        self.seed = seed
        self.index = index
        self.draws = 0

    def params(self) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(self.seed), self.index(self.draws))
        self.draws += 1
        return key


def draws_per_block(cfg: ModelConfig) -> int:
    """How many random parameters one block of `cfg` draws (shapes only, nothing computed)."""
    keys = DrawKeys(0)
    nnx.eval_shape(lambda: Block(cfg, rngs=keys))
    return keys.draws


def _params(module: nnx.Module) -> dict[str, Any]:
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def outer_params(cfg: ModelConfig, seed: int) -> dict[str, Any]:
    """Every parameter outside the blocks, each from its draw in the whole model's order."""
    last_draw = 1 + cfg.num_layers * draws_per_block(cfg)  # the head, after every block
    no_blocks = dataclasses.replace(cfg, num_layers=0, scan_layers=False)
    keys = DrawKeys(seed, lambda n: (0, last_draw)[n])
    params = _params(Transformer(no_blocks, rngs=keys))
    params.pop("blocks", None)
    return params


def block_params(cfg: ModelConfig, seed: int, first_draw: jax.Array) -> dict[str, Any]:
    """The parameters of the block whose first draw is `first_draw` (int32 [], traced)."""
    return _params(Block(cfg, rngs=DrawKeys(seed, lambda n: first_draw + n)))


def first_draws(cfg: ModelConfig) -> np.ndarray:
    """int32 [num_layers]: the index of each block's first draw (the embedding is draw 0)."""
    return 1 + draws_per_block(cfg) * np.arange(cfg.num_layers, dtype=np.int32)


def initial_params_programs(
    cfg: ModelConfig, seed: int, shardings: dict[str, Any]
) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
    """The outer and block programs, lowered with `shardings` (the model's parameter
    shardings) as out shardings. The block program takes the first draw of a block (int32
    []) or, with scan_layers, of every block (int32 [num_layers])."""
    outer_shardings = {name: value for name, value in shardings.items() if name != "blocks"}
    outer = jax.jit(lambda: outer_params(cfg, seed), out_shardings=outer_shardings).lower()
    if cfg.scan_layers:
        stacked = jax.vmap(lambda first: block_params(cfg, seed, first))
        block = jax.jit(stacked, out_shardings=shardings["blocks"]).lower(first_draws(cfg))
    else:
        one = jax.jit(
            lambda first: block_params(cfg, seed, first), out_shardings=shardings["blocks"][0]
        )
        block = one.lower(np.int32(0))
    return outer, block


def initial_params(
    cfg: ModelConfig,
    seed: int,
    shardings: dict[str, Any],
    compile_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The parameters Transformer(cfg, rngs=nnx.Rngs(seed)) holds, as a nested dict of arrays
    in `shardings`, each device computing only its own shards."""
    outer, block = (
        lowered.compile(compiler_options=compile_options)
        for lowered in initial_params_programs(cfg, seed, shardings)
    )
    params = outer()
    firsts = first_draws(cfg)
    if cfg.scan_layers:
        params["blocks"] = block(firsts)
    else:
        params["blocks"] = {layer: block(first) for layer, first in enumerate(firsts)}
    return params
