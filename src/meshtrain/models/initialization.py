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

LoRA adapters (models.lora) draw from a stream of their own, DrawKeys.lora, so that a model with
adapters holds the same base values as one without. `initial_adapters` builds only the
adapters, for a base read from disk: the same programs, whose base draws XLA then drops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from meshtrain.config.schema import ModelConfig
from meshtrain.models.block import Block
from meshtrain.models.lora import split_adapters
from meshtrain.models.transformer import Transformer

# Folded into the seed for the adapters' stream: far from the base draws' small indices and from
# the train step's stream (train.state).
LORA_STREAM = (1 << 20) + 1


class DrawKeys:
    """Stands in for nnx.Rngs(seed) while parameters are built: the n-th call of `params()`
    returns the key nnx.Rngs(seed).params() returns at its draw `index(n)` (default: n); the
    n-th call of `lora()` the key of draw `lora_index(n)` of the adapters' stream."""

    def __init__(
        self,
        seed: int,
        index: Callable[[int], Any] = lambda n: n,
        lora_index: Callable[[int], Any] = lambda n: n,
    ) -> None:
        self.seed = seed
        self.index, self.lora_index = index, lora_index
        self.draws = self.lora_draws = 0

    def params(self) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(self.seed), self.index(self.draws))
        self.draws += 1
        return key

    def lora(self) -> jax.Array:
        stream = jax.random.fold_in(jax.random.key(self.seed), LORA_STREAM)
        key = jax.random.fold_in(stream, self.lora_index(self.lora_draws))
        self.lora_draws += 1
        return key


def draws_per_block(cfg: ModelConfig) -> tuple[int, int]:
    """How many random base parameters and adapters one block of `cfg` draws (shapes only)."""
    keys = DrawKeys(0)
    nnx.eval_shape(lambda: Block(cfg, rngs=keys))
    return keys.draws, keys.lora_draws


def _params(module: nnx.Module) -> dict[str, Any]:
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def outer_params(cfg: ModelConfig, seed: int) -> dict[str, Any]:
    """Every parameter outside the blocks, each from its draw in the whole model's order."""
    last_draw = 1 + cfg.num_layers * draws_per_block(cfg)[0]  # the head, after every block
    no_blocks = dataclasses.replace(cfg, num_layers=0, scan_layers=False)
    keys = DrawKeys(seed, lambda n: (0, last_draw)[n])
    params = _params(Transformer(no_blocks, rngs=keys))
    params.pop("blocks", None)
    return params


def block_params(cfg: ModelConfig, seed: int, first_draws: jax.Array) -> dict[str, Any]:
    """The parameters of the block whose first draws are `first_draws` (int32 [2], traced: of
    the base stream and of the adapters' stream)."""
    keys = DrawKeys(seed, lambda n: first_draws[0] + n, lambda n: first_draws[1] + n)
    return _params(Block(cfg, rngs=keys))


def first_draws(cfg: ModelConfig) -> np.ndarray:
    """int32 [num_layers, 2]: the index of each block's first base draw (the embedding is draw
    0) and first adapter draw."""
    base, lora = draws_per_block(cfg)
    layers = np.arange(cfg.num_layers, dtype=np.int32)
    return np.stack([1 + base * layers, lora * layers], axis=1).astype(np.int32)


def _everything(params: dict[str, Any]) -> dict[str, Any]:
    return params


def _adapters(params: dict[str, Any]) -> dict[str, Any]:
    return split_adapters(params)[0]


def initial_params_programs(
    cfg: ModelConfig,
    seed: int,
    shardings: dict[str, Any],
    *,
    adapters_only: bool = False,
) -> tuple[jax.stages.Lowered | None, jax.stages.Lowered]:
    """The outer and block programs, lowered with `shardings` (those of every parameter, or
    of the LoRA adapters only) as out shardings; no outer program when none of those are
    outside the blocks. The block program takes the first draws of a block (int32 [2]) or,
    with scan_layers, of every block (int32 [num_layers, 2])."""
    select = _adapters if adapters_only else _everything
    outer_shardings = {name: value for name, value in shardings.items() if name != "blocks"}
    outer = None
    if outer_shardings:
        outer_program = lambda: select(outer_params(cfg, seed))  # noqa: E731
        outer = jax.jit(outer_program, out_shardings=outer_shardings).lower()
    block_program = lambda first: select(block_params(cfg, seed, first))  # noqa: E731
    if cfg.scan_layers:
        stacked = jax.vmap(block_program)
        block = jax.jit(stacked, out_shardings=shardings["blocks"]).lower(first_draws(cfg))
    else:
        one = jax.jit(block_program, out_shardings=shardings["blocks"][0])
        block = one.lower(first_draws(cfg)[0])
    return outer, block


def initial_params(
    cfg: ModelConfig,
    seed: int,
    shardings: dict[str, Any],
    compile_options: dict[str, Any] | None = None,
    *,
    adapters_only: bool = False,
) -> dict[str, Any]:
    """The parameters Transformer(cfg, rngs=nnx.Rngs(seed)) holds, as a nested dict of arrays
    in `shardings`, each device computing only its own shards. adapters_only: only the LoRA
    adapters (`shardings` theirs), as the whole model would draw them."""
    programs = initial_params_programs(cfg, seed, shardings, adapters_only=adapters_only)
    outer, block = (
        None if lowered is None else lowered.compile(compiler_options=compile_options)
        for lowered in programs
    )
    params = {} if outer is None else outer()
    firsts = first_draws(cfg)
    if cfg.scan_layers:
        params["blocks"] = block(firsts)
    else:
        params["blocks"] = {layer: block(first) for layer, first in enumerate(firsts)}
    return params
