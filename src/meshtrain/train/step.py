"""One jitted train step (gradient accumulation, mixed precision) and an eval step.

Batches are int32 [accum, micro_global, seq_len + 1]. What the step minimises is its objective's
(train.objectives: the next-token loss by default): the objective returns the sums of each
micro-batch's rows, the step adds them up over the micro-batches and devices (how the
gradients are summed and reduced over the batch axes is train.gradients') and divides the loss
sum and the gradients by the count of the whole update, so no split of the batch weighs its
rows differently. Then the optimizer update, guarded against non-finite steps (train.guard).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from meshtrain.config.schema import MixedPrecision, TrainingConfig
from meshtrain.models.abstract import AbstractModel, without_mesh_axes
from meshtrain.models.attention_choice import select_attention
from meshtrain.models.lora import row_keys
from meshtrain.parallel.context import sequence_shards
from meshtrain.train.gradients import (
    Sums,
    gradient_sync,
    grouped_accumulate,
    implicit_accumulate,
)
from meshtrain.train.guard import guard_update
from meshtrain.train.objectives.base import Objective
from meshtrain.train.state import TrainState

log = logging.getLogger(__name__)

COMPUTE_DTYPES: dict[MixedPrecision, jnp.dtype] = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def attention_choice(model: AbstractModel, mixed_precision: str) -> tuple[str, str]:
    """The attention kernel the step runs at `mixed_precision` on the mesh being compiled for,
    and why."""
    mesh = jax.tree.leaves(model.param_shardings)[0].mesh
    return select_attention(
        model.config.attention,
        dtype=COMPUTE_DTYPES[mixed_precision],
        head_dim=model.config.head_dim,
        context_shards=sequence_shards(mesh.shape, model.config.logical_axis_rules),
    )


def make_train_step(
    model: AbstractModel,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    state_shardings: TrainState,
    batch_sharding: jax.sharding.NamedSharding,
    objective: Objective,
    training: TrainingConfig,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """The compiled update: (state, batch) → (new state, metrics), with the state donated.

    `objective` computes the loss of the rows of each micro-batch (train.objectives), built for
    training.mixed_precision's compute dtype. From `training`: how the gradients are reduced
    (train.gradients: gradient_accumulation_steps, sync_gradients_every, reduce_dtype), and
    `nonfinite`: "skip" drops an update whose loss or gradient norm is not finite; either way
    the first such step is recorded in `state.nonfinite` (see train.guard).
    """
    nonfinite = training.nonfinite
    if model.config is not None:
        log.info("attention: %s (%s)", *attention_choice(model, training.mixed_precision))
    param_shardings = state_shardings.params
    mesh = jax.tree.leaves(param_shardings)[0].mesh

    sync = gradient_sync(training, mesh, model.config.logical_axis_rules)
    if sync.grouped:
        grouped_model = without_mesh_axes(model, sync.grouped)
        loss_and_grads = objective.loss_and_grads(grouped_model)
        accumulate = grouped_accumulate(loss_and_grads, param_shardings, sync)
    else:
        accumulate = implicit_accumulate(objective.loss_and_grads(model), param_shardings)

    dropout = model.config.lora.dropout if model.lora else 0.0

    def with_dropout_keys(state: TrainState, batch: jax.Array) -> Any:
        """The batch, with LoRA dropout the key of each of its sequences as well: the step's
        key folded with the sequence's index in the global batch (models.lora.row_keys)."""
        if not dropout:
            return batch
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        rows = jnp.arange(batch.shape[0] * batch.shape[1], dtype=jnp.int32)
        keys = row_keys(step_key, rows.reshape(batch.shape[:2]))  # [accum, micro_global, 2]
        return batch, jax.lax.with_sharding_constraint(keys, batch_sharding)

    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        rows = with_dropout_keys(state, batch)
        grad_sum, sums = accumulate(state.params, rows, state.frozen)
        count = jnp.maximum(sums["count"], 1.0)
        grads = jax.tree.map(lambda g: g / count, grad_sum)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        logged = objective.metrics({**sums, "count": count})  # "loss", then its own
        loss = logged.pop("loss")
        step = state.step + 1
        (params, opt_state), record = guard_update(
            (state.params, state.opt_state),
            (params, opt_state),
            state.nonfinite,
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            skip=nonfinite == "skip",
        )
        metrics = {"loss": loss, "learning_rate": schedule(state.step), "grad_norm": grad_norm}
        if nonfinite == "skip":
            metrics["nonfinite_skips"] = record.skipped
        metrics.update(logged)
        new_state = state.replace(step=step, params=params, opt_state=opt_state, nonfinite=record)
        return new_state, metrics

    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )


def make_eval_step(
    model: AbstractModel,
    *,
    state_shardings: TrainState,
    batch_sharding: jax.sharding.NamedSharding,
    objective: Objective,
) -> Callable[[Any, Any, jax.Array], Sums]:
    """Compiled (params, frozen, batch [B, seq_len + 1]) → the objective's sums of the batch
    (train.gradients.Sums): the train state's parameters, and its frozen base with LoRA (else
    None)."""

    def evaluate(params: Any, frozen: Any, batch: jax.Array) -> Sums:
        return objective.sums(model, params, batch, frozen)

    shardings = (state_shardings.params, state_shardings.frozen, batch_sharding)
    return jax.jit(evaluate, in_shardings=shardings)
