"""The next-token objective (objective=lm, the default; pretraining and SFT): the summed
cross-entropy of the targets that carry loss (not padding; for chat data, the trained tokens)
over their number, so accumulating 4 micro-batches of 2 equals one micro-batch of 8 and no split
of the batch weighs its tokens differently. The loss fuses the model's output projection with
the cross-entropy (train.loss): no [B, T, V] log-probabilities, nor logits kept for the backward
pass. It runs under every pipeline schedule (1f1b computes its gradients itself).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from meshtrain.models.abstract import AbstractModel, merge_model
from meshtrain.models.lora import AdapterDropout, split_adapters
from meshtrain.models.routing import MoeStats
from meshtrain.models.transformer import default_positions
from meshtrain.parallel.rules import constrain
from meshtrain.train.documents import TokenFormat
from meshtrain.train.gradients import LossAndGrads, Sums
from meshtrain.train.loss import output_cross_entropy
from meshtrain.train.objectives.base import Objective, cast_params, read_in_layout
from meshtrain.train.pipeline import loss_rules, one_f_one_b, pipelined_hidden
from meshtrain.train.pipeline_plan import PipelinePlan


class NextToken(Objective):
    """objective=lm: see the module docstring."""

    name = "lm"
    schedules = frozenset({"gpipe", "circular", "1f1b"})
    context_parallel = True
    perplexity = True

    def sums(
        self,
        model: AbstractModel,
        params: Any,
        rows: Any,
        frozen: Any,
        dropout: AdapterDropout | None = None,
    ) -> Sums:
        inputs = self.inputs
        loss, count, stats = token_loss_sum(
            model,
            model.full_params(params, frozen),
            rows,
            token_format=inputs.token_format,
            compute_dtype=inputs.compute_dtype,
            pipeline=inputs.pipeline,
            dropout=dropout,
        )
        return self.with_auxiliary({"loss": loss, "count": count}, stats)

    def loss_and_grads(self, model: AbstractModel) -> LossAndGrads:
        pipeline = self.inputs.pipeline
        if pipeline is None or pipeline.schedule != "1f1b":
            return super().loss_and_grads(model)

        def loss_and_grads(params: Any, tokens: Any, frozen: Any) -> tuple[Sums, Any]:
            (loss, count), grads = one_f_one_b_loss_and_grads(
                model,
                params,
                tokens,
                frozen,
                token_format=self.inputs.token_format,
                compute_dtype=self.inputs.compute_dtype,
                pipeline=pipeline,
            )
            return {"loss": loss, "count": count}, grads

        return loss_and_grads


def token_loss_sum(
    model: AbstractModel,
    params: Any,
    tokens: jax.Array,
    *,
    token_format: TokenFormat,
    compute_dtype: jnp.dtype,
    pipeline: PipelinePlan | None = None,
    dropout: AdapterDropout | None = None,
) -> tuple[jax.Array, jax.Array, MoeStats | None]:
    """Summed cross-entropy over the targets that carry loss, their count, and a mixture of
    experts' routing statistics (None without experts, or with a pipeline). tokens:
    [B, seq_len + 1].

    With document masking (token_format.documents), a token attends only to the earlier tokens
    of its own packed document, at positions that restart with each document. With `pipeline`,
    the blocks run as its schedule's forward over the pp stages (train.pipeline). dropout: the
    LoRA adapters' (training only; not with a pipeline)."""
    net = merge_model(model, cast_params(model, params, compute_dtype))
    inputs, targets, mask, segment_ids, positions = read_in_layout(token_format, tokens, net.rules)
    if pipeline is None:
        hidden, stats = net.hidden_and_stats(
            inputs, positions, segment_ids, dropout, in_layout=True
        )
        weight, layout = net.output_weight()
        loss = output_cross_entropy(hidden, weight, layout, targets, mask, rules=net.rules)
        return loss, jnp.sum(mask), stats
    x = net.embed_tokens(inputs)
    kernel, _ = net.attention_kernel(x.dtype)
    positions = default_positions(inputs) if positions is None else positions
    hidden = pipelined_hidden(net, x, positions, segment_ids, pipeline, kernel)
    rules = loss_rules(net.rules, pipeline)
    loss = _head_loss(
        net, constrain(hidden, ("batch", "length", None), rules), targets, mask, rules
    )
    return loss, jnp.sum(mask), None


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
