"""The train state, created directly in its shardings: no full copy on one device or the host."""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.config.schema import ModelConfig
from meshtrain.models.abstract import AbstractModel
from meshtrain.models.initialization import initial_params
from meshtrain.train.guard import NonfiniteRecord, initial_record

# Folded into the seed for the train-step key, far from the small counters nnx folds into the
# same seed while initialising parameters, so the two streams never share a key.
_STEP_RNG_STREAM = 1 << 20


@struct.dataclass
class TrainState:
    """Everything a train step changes, and so everything a checkpoint must hold.

    `params` is a nested dict of fp32 arrays (the nnx.Param values of the model that train:
    all of them, or with LoRA the adapters, beside the frozen base in `frozen`); `step` counts
    the train steps taken (batches consumed), skipped updates included. `rng` is the raw data of
    the key that stochastic layers draw from: a layer that needs randomness at step k uses
    `jax.random.fold_in(jax.random.wrap_key_data(rng), k)`: LoRA's adapter dropout does. The key
    is checkpointed and restored, so a resumed run draws exactly what it would have.
    """

    step: jax.Array  # int32 []
    params: Any
    opt_state: optax.OptState
    rng: jax.Array  # uint32 [2]: jax.random.key_data of the train-step key
    nonfinite: NonfiniteRecord
    # What the loss reads but does not train, never updated nor checkpointed: with LoRA the
    # frozen base (models.frozen; `params` then holds the adapters only); with an objective that
    # reads a reference (train.objectives: DPO) and no LoRA, a copy of the starting weights in
    # the parameters' shardings. Else None.
    frozen: Any = None


def state_shardings(
    model: AbstractModel, tx: optax.GradientTransformation, mesh: Mesh, *, reference: bool = False
) -> TrainState:
    """Shardings of the whole train state: Adam's moments follow their parameters; `reference`:
    a copy of the starting weights in `frozen` (without LoRA), sharded like the parameters."""
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt_state = jax.eval_shape(tx.init, model.trainable_params)
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract_opt_state,
        model.trainable_shardings,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(
        step=replicated,
        params=model.trainable_shardings,
        opt_state=opt_shardings,
        rng=replicated,
        nonfinite=jax.tree.map(lambda _: replicated, initial_record()),
        frozen=model.trainable_shardings
        if reference and not model.lora
        else model.frozen_shardings,
    )


def _state_from_params(params: Any, tx: optax.GradientTransformation, seed: int) -> TrainState:
    """Step 0 around given parameters: a fresh optimizer state, the seed's train-step key."""
    key = jax.random.fold_in(jax.random.key(seed), _STEP_RNG_STREAM)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key_data(key),
        nonfinite=initial_record(),
    )


def create_train_state(
    cfg: ModelConfig,
    tx: optax.GradientTransformation,
    shardings: TrainState,
    seed: int,
    params: Any = None,
    frozen: Any = None,
) -> TrainState:
    """The train state at step 0, created in its shardings, so each device only ever
    materialises its own shards: random parameters (meshtrain.models.initialization: the same
    values on every mesh; with LoRA the adapters, as the whole model draws them) unless
    `params` are given (already sharded: loaded by meshtrain.weights.initial_weights; they are
    donated), then the optimizer state around them; with LoRA, beside the `frozen` base."""
    options = init_compiler_options(shardings)
    if params is None:
        adapters_only = frozen is not None
        params = initial_params(cfg, seed, shardings.params, options, adapters_only=adapters_only)
    program = state_program(tx, shardings, seed, jax.tree.map(_abstract, params))
    return program.compile(compiler_options=options)(params).replace(frozen=frozen)


def _abstract(array: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding)


def state_program(
    tx: optax.GradientTransformation, shardings: TrainState, seed: int, abstract_params: Any
) -> jax.stages.Lowered:
    """The program that puts a fresh optimizer state and the seed's key around parameters
    (ShapeDtypeStructs with their shardings), which it donates."""
    return jax.jit(
        lambda p: _state_from_params(p, tx, seed),
        out_shardings=shardings.replace(frozen=None),
        donate_argnums=0,
    ).lower(abstract_params)


def init_compiler_options(shardings: TrainState) -> dict[str, Any]:
    """XLA options for the one-off initialisation programs. On CPU, LLVM's default optimisation
    spends seconds on the random initialisers of a program that runs once: level 1 compiled the
    tiny model's init 3× faster (2.1 s against 6.2 s) and ran it as fast (docs/performance.md).
    A lower level set for every program in XLA_FLAGS is kept (an option given to one compile
    overrides the flag)."""
    platform = next(iter(shardings.step.mesh.devices.flat)).platform
    if platform != "cpu":
        return {}
    return {"xla_backend_optimization_level": min(1, _flagged_optimization_level())}


def _flagged_optimization_level() -> int:
    """The CPU backend's optimisation level XLA_FLAGS sets, else XLA's default (2)."""
    found = re.findall(r"--xla_backend_optimization_level=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 2


def split_state(state: TrainState) -> tuple[Any, TrainState]:
    """(parameters, the rest of the state): the two items of a checkpoint. A LoRA run's frozen
    base is in neither (its checkpoints name it: weights.lora_base)."""
    return state.params, state.replace(params=None, frozen=None)


def join_state(params: Any, rest: TrainState, frozen: Any = None) -> TrainState:
    return rest.replace(params=params, frozen=frozen)


def train_state_shapes(model: AbstractModel, tx: optax.GradientTransformation) -> TrainState:
    """The train state as ShapeDtypeStructs without shardings: its structure, allocating nothing."""
    state = jax.eval_shape(lambda p: _state_from_params(p, tx, 0), model.trainable_params)
    return state.replace(frozen=model.frozen_params)


def abstract_train_state(
    model: AbstractModel, tx: optax.GradientTransformation, shardings: TrainState
) -> TrainState:
    """The train state as ShapeDtypeStructs carrying their shardings, allocating nothing: the
    restore target of a checkpoint, and enough to compile the train step."""
    shapes = train_state_shapes(model, tx)
    if shardings.frozen is not None and not model.lora:  # a reference copy of the parameters
        shapes = shapes.replace(frozen=shapes.params)
    return jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        shapes,
        shardings,
    )
