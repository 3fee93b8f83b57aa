"""One jitted train step (gradient accumulation, mixed precision) and an eval step.

Batches are int32 [accum, micro_global, seq_len + 1]: inputs are tokens[..., :-1] and targets
tokens[..., 1:] (train.documents.TokenFormat reads them). The loss is the sum of the losses of
all target tokens of the update that carry loss (not padding; for chat data, the trained tokens)
divided by their number, so accumulating 4 micro-batches of 2 equals one micro-batch of 8 and
no split of the batch weighs its tokens differently. How the micro-batches'
gradients are summed and reduced over the batch axes is train.gradients'. The loss fuses the
model's output projection with the cross-entropy (train.loss): no [B, T, V]
log-probabilities, nor logits kept for the backward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from meshtrain.config.schema import MixedPrecision, TrainingConfig
from meshtrain.models.abstract import AbstractModel, merge_model, without_mesh_axes
from meshtrain.models.attention_choice import select_attention
from meshtrain.models.frozen import is_quantized
from meshtrain.models.lora import AdapterDropout, row_keys, split_adapters
from meshtrain.models.transformer import default_positions
from meshtrain.parallel.context import context_layout, sequence_shards, split_sequences
from meshtrain.parallel.rules import constrain
from meshtrain.train.documents import TokenFormat
from meshtrain.train.gradients import (
    LossAndGrads,
    gradient_sync,
    grouped_accumulate,
    implicit_accumulate,
)
from meshtrain.train.guard import guard_update
from meshtrain.train.loss import output_cross_entropy
from meshtrain.train.pipeline import loss_rules, one_f_one_b, pipelined_hidden
from meshtrain.train.pipeline_plan import PipelinePlan
from meshtrain.train.state import TrainState

log = logging.getLogger(__name__)

COMPUTE_DTYPES: dict[MixedPrecision, jnp.dtype] = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def cast_params(model: AbstractModel, params: Any, compute_dtype: jnp.dtype) -> Any:
    """The fp32 master weights in the compute dtype, cast where they are stored: each cast is
    pinned to its parameter's sharding, so FSDP all-gathers move compute-dtype bytes (half of
    fp32 in bf16), not fp32 ones cast after the gather."""

    def cast(param: Any, sharding: jax.sharding.NamedSharding) -> Any:
        if is_quantized(param):  # QLoRA: dequantised to the compute dtype where it is read
            return param.astype(compute_dtype)
        if param.dtype == compute_dtype:
            return param
        return jax.lax.with_sharding_constraint(param.astype(compute_dtype), sharding)

    return jax.tree.map(cast, params, model.param_shardings, is_leaf=is_quantized)


def read_in_layout(
    token_format: TokenFormat, tokens: jax.Array, rules: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """token_format.read(tokens), and under a mesh that splits sequences over cp, the five
    arrays in the context layout (meshtrain.parallel.context), positions included: segment
    ids and positions are read from the tokens in sequence order first."""
    inputs, targets, mask, segment_ids, positions = token_format.read(tokens)
    if context_layout(inputs.shape[1], rules) is None:
        return inputs, targets, mask, segment_ids, positions
    positions = default_positions(inputs) if positions is None else positions
    return split_sequences(rules, inputs, targets, mask, segment_ids, positions)


def token_loss_sum(
    model: AbstractModel,
    params: Any,
    tokens: jax.Array,
    *,
    token_format: TokenFormat,
    compute_dtype: jnp.dtype,
    pipeline: PipelinePlan | None = None,
    dropout: AdapterDropout | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Summed cross-entropy over the targets that carry loss, and their count. tokens:
    [B, seq_len + 1].

    With document masking (token_format.documents), a token attends only to the earlier tokens
    of its own packed document, at positions that restart with each document. With `pipeline`,
    the blocks run as its schedule's forward over the pp stages (train.pipeline). dropout: the
    LoRA adapters' (training only; not with a pipeline)."""
    net = merge_model(model, cast_params(model, params, compute_dtype))
    inputs, targets, mask, segment_ids, positions = read_in_layout(token_format, tokens, net.rules)
    if pipeline is None:
        hidden = net.hidden(inputs, positions, segment_ids, dropout, in_layout=True)
        weight, layout = net.output_weight()
        loss = output_cross_entropy(hidden, weight, layout, targets, mask, rules=net.rules)
        return loss, jnp.sum(mask)
    x = net.embed_tokens(inputs)
    kernel, _ = net.attention_kernel(x.dtype)
    positions = default_positions(inputs) if positions is None else positions
    hidden = pipelined_hidden(net, x, positions, segment_ids, pipeline, kernel)
    rules = loss_rules(net.rules, pipeline)
    loss = _head_loss(
        net, constrain(hidden, ("batch", "length", None), rules), targets, mask, rules
    )
    return loss, jnp.sum(mask)


def _head_loss(
    net: Any, hidden: jax.Array, targets: jax.Array, mask: jax.Array, rules: Any
) -> jax.Array:
    """The final norm, the output projection and the summed cross-entropy of hidden [B, T, D]."""
    weight, layout = net.output_weight()
    return output_cross_entropy(net.final_norm(hidden), weight, layout, targets, mask, rules=rules)


def one_f_one_b_loss_and_grads(
    model: AbstractModel,
    params: Any,
    tokens: jax.Array,
    frozen: Any,
    *,
    token_format: TokenFormat,
    compute_dtype: jnp.dtype,
    pipeline: PipelinePlan,
) -> tuple[tuple[jax.Array, jax.Array], Any]:
    """((summed loss, token count), gradients of `params`) of token_loss_sum under the 1f1b
    schedule, which computes the gradients itself (train.pipeline.one_f_one_b); with LoRA,
    `params` are the adapters and `frozen` the base."""
    rules = model.config.logical_axis_rules
    inputs, targets, mask, segment_ids, positions = read_in_layout(token_format, tokens, rules)
    positions = default_positions(inputs) if positions is None else positions
    compute_params = cast_params(model, model.full_params(params, frozen), compute_dtype)
    net = merge_model(model, compute_params)
    blocks = compute_params["blocks"]
    trainable, compute_frozen = (
        split_adapters(compute_params) if model.lora else (compute_params, None)
    )

    def with_outer(outer: Any) -> Any:
        return merge_model(model, {**outer, "blocks": blocks})

    def head_loss(outer, hidden, targets, mask):
        return _head_loss(with_outer(outer), hidden, targets, mask, net.rules)

    kernel, _ = net.attention_kernel(compute_dtype)
    loss, grads = one_f_one_b(
        net,
        trainable,
        lambda outer: with_outer(outer).embed_tokens(inputs),
        head_loss,
        targets,
        mask,
        positions,
        segment_ids,
        pipeline,
        kernel,
        frozen=compute_frozen,
    )
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return (loss, jnp.sum(mask)), grads


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
    token_format: TokenFormat,
    training: TrainingConfig,
    pipeline: PipelinePlan | None = None,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """The compiled update: (state, batch) → (new state, metrics), with the state donated.

    From `training`: the compute dtype (mixed_precision), how the gradients are reduced
    (train.gradients: gradient_accumulation_steps, sync_gradients_every, reduce_dtype), and
    `nonfinite`: "skip" drops an update whose loss or gradient norm is not finite; either way
    the first such step is recorded in `state.nonfinite` (see train.guard).
    """
    mixed_precision, nonfinite = training.mixed_precision, training.nonfinite
    compute_dtype = COMPUTE_DTYPES[mixed_precision]
    if model.config is not None:
        log.info("attention: %s (%s)", *attention_choice(model, mixed_precision))
    param_shardings = state_shardings.params
    mesh = jax.tree.leaves(param_shardings)[0].mesh

    def loss_and_grads(model: AbstractModel) -> LossAndGrads:
        if pipeline is not None and pipeline.schedule == "1f1b":
            return lambda params, tokens, frozen: one_f_one_b_loss_and_grads(
                model,
                params,
                tokens,
                frozen,
                token_format=token_format,
                compute_dtype=compute_dtype,
                pipeline=pipeline,
            )

        def loss(params: Any, rows: Any, frozen: Any) -> tuple[jax.Array, jax.Array]:
            tokens, keys = rows if isinstance(rows, tuple) else (rows, None)
            return token_loss_sum(
                model,
                model.full_params(params, frozen),
                tokens,
                token_format=token_format,
                compute_dtype=compute_dtype,
                pipeline=pipeline,
                dropout=None if keys is None else AdapterDropout(keys),
            )

        # Differentiated with respect to the trainable parameters only: a LoRA run's frozen
        # base gets no gradient computed at all.
        return jax.value_and_grad(loss, has_aux=True)

    sync = gradient_sync(training, mesh, model.config.logical_axis_rules)
    if sync.grouped:
        grouped_model = without_mesh_axes(model, sync.grouped)
        accumulate = grouped_accumulate(loss_and_grads(grouped_model), param_shardings, sync)
    else:
        accumulate = implicit_accumulate(loss_and_grads(model), param_shardings)

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
        grad_sum, loss_sum, count = accumulate(state.params, rows, state.frozen)
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
    state_shardings: TrainState,
    batch_sharding: jax.sharding.NamedSharding,
    token_format: TokenFormat,
    mixed_precision: str,
    pipeline: PipelinePlan | None = None,
) -> Callable[[Any, Any, jax.Array], tuple[jax.Array, jax.Array]]:
    """Compiled (params, frozen, batch [B, seq_len + 1]) → (summed loss, token count): the
    train state's parameters, and its frozen base with LoRA (else None)."""
    compute_dtype = COMPUTE_DTYPES[mixed_precision]

    def evaluate(params: Any, frozen: Any, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
        return token_loss_sum(
            model,
            model.full_params(params, frozen),
            batch,
            token_format=token_format,
            compute_dtype=compute_dtype,
            pipeline=pipeline,
        )

    shardings = (state_shardings.params, state_shardings.frozen, batch_sharding)
    return jax.jit(evaluate, in_shardings=shardings)
