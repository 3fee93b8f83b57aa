"""One jitted train step (gradient accumulation as a lax.scan, mixed precision) and an eval step.

Batches are int32 [accum, micro_global, seq_len + 1]: inputs are tokens[..., :-1] and targets
tokens[..., 1:]. The loss is the mean over all target tokens of the update that are not padding,
so accumulating 4 micro-batches of 2 equals one micro-batch of 8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from meshtrain.config.schema import MixedPrecision
from meshtrain.models.abstract import AbstractModel, merge_model
from meshtrain.train.guard import guard_update
from meshtrain.train.state import TrainState

COMPUTE_DTYPES: dict[MixedPrecision, jnp.dtype] = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def token_loss_sum(
    model: AbstractModel, params: Any, tokens: jax.Array, *, pad_id: int, compute_dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """Summed cross-entropy over non-pad targets, and their count. tokens: [B, seq_len + 1]."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # [B, T] each
    # fp32 master weights; the matmuls run in the compute dtype.
    compute_params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    logits = merge_model(model, compute_params)(inputs).astype(jnp.float32)  # [B, T, V]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    target_log_probs = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    mask = (targets != pad_id).astype(jnp.float32)  # [B, T]
    return -jnp.sum(target_log_probs * mask), jnp.sum(mask)


def make_train_step(
    model: AbstractModel,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    state_shardings: TrainState,
    batch_sharding: jax.sharding.NamedSharding,
    pad_id: int,
    mixed_precision: str,
    nonfinite: str = "stop",
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """The compiled update: (state, batch) → (new state, metrics), with the state donated.

    `nonfinite` (training.nonfinite): "skip" drops an update whose loss or gradient norm is not
    finite; either way the first such step is recorded in `state.nonfinite` (see train.guard).
    """
    compute_dtype = COMPUTE_DTYPES[mixed_precision]
    grad_fn = jax.value_and_grad(
        lambda params, tokens: token_loss_sum(
            model, params, tokens, pad_id=pad_id, compute_dtype=compute_dtype
        ),
        has_aux=True,
    )

    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        def accumulate(carry, micro_batch):  # micro_batch: [micro_global, seq_len + 1]
            grad_sum, loss_sum, count = carry
            (loss, tokens), grads = grad_fn(state.params, micro_batch)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            grad_sum = jax.lax.with_sharding_constraint(grad_sum, state_shardings.params)
            return (grad_sum, loss_sum + loss, count + tokens), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        (grad_sum, loss_sum, count), _ = jax.lax.scan(accumulate, init, batch)
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grad_sum)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        loss = loss_sum / count
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
    param_shardings: Any,
    batch_sharding: jax.sharding.NamedSharding,
    pad_id: int,
    mixed_precision: str,
) -> Callable[[Any, jax.Array], tuple[jax.Array, jax.Array]]:
    """Compiled (params, batch [B, seq_len + 1]) → (summed loss, token count)."""
    compute_dtype = COMPUTE_DTYPES[mixed_precision]

    def evaluate(params: Any, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
        return token_loss_sum(model, params, batch, pad_id=pad_id, compute_dtype=compute_dtype)

    return jax.jit(evaluate, in_shardings=(param_shardings, batch_sharding))
