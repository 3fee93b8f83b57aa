"""The policy's and the reference's log-probability of each target token of some rows, for the
objectives whose loss is a function of them (preference, policy gradient), and that loss with
its gradient.

Such a loss L(log p_1, …, log p_T) has the gradient Σ_t c_t ∇log p(target_t), with
c_t = ∂L/∂log p_t: the fused output projection + cross-entropy (train.loss.output_cross_entropy)
computes exactly that with each token weighed by −c_t, without materialising [B, T, V]
(`TokenScores.loss_with_gradient`). The reference runs forward only, under stop_gradient: the
frozen copy of the starting weights in the state's `frozen`, or with LoRA the base with the
adapters off (no second copy of the weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.models.abstract import AbstractModel, merge_model
from meshtrain.models.lora import AdapterDropout
from meshtrain.models.routing import MoeStats
from meshtrain.train.loss import output_cross_entropy, target_log_probs
from meshtrain.train.objectives.base import StepInputs, cast_params


@dataclass(frozen=True)
class TokenScores:
    """The policy's pass over some rows: what the tokens read as (train.documents.TokenFormat)
    and each target's log-probability, with what the gradient's second pass needs."""

    targets: jax.Array  # int32 [B, T]
    mask: jax.Array  # fp32 [B, T], 1 where the target carries loss
    segment_ids: jax.Array  # int32 [B, T], the document of each token (from 1)
    log_probs: jax.Array  # fp32 [B, T], log p(target_t) under the policy; not differentiated
    hidden: jax.Array  # [B, T, D], the final-normed hidden states
    weight: jax.Array  # the output projection
    layout: str  # its layout (train.loss)
    rules: Any  # the logical axis rules
    positions: jax.Array | None
    inputs: jax.Array  # int32 [B, T]
    entropy: jax.Array | None = None  # fp32 [B, T], the policy's at each position, if asked
    stats: MoeStats | None = None  # a mixture of experts' routing statistics (its aux losses)

    def loss_with_gradient(self, loss: jax.Array, coefficients: jax.Array) -> jax.Array:
        """`loss` (its value), with the gradient Σ_t c_t ∇log p_t: coefficients fp32 [B, T] are
        c_t = ∂loss/∂log p_t (zero where the target carries no loss)."""
        surrogate = output_cross_entropy(
            self.hidden, self.weight, self.layout, self.targets, -coefficients, rules=self.rules
        )
        return surrogate + jax.lax.stop_gradient(loss - surrogate)


def policy_scores(
    inputs: StepInputs,
    model: AbstractModel,
    params: Any,
    frozen: Any,
    rows: jax.Array,
    dropout: AdapterDropout | None = None,
    *,
    entropy: bool = False,
) -> TokenScores:
    """The policy's log-probability of each target of `rows` (tokens [B, seq_len + 1]), and with
    `entropy` the entropy of its prediction at each position."""
    dtype = inputs.compute_dtype
    tokens, targets, mask, segment_ids, positions = inputs.token_format.read(rows)
    net = merge_model(model, cast_params(model, model.full_params(params, frozen), dtype))
    hidden, stats = net.hidden_and_stats(tokens, positions, segment_ids, dropout, in_layout=True)
    weight, layout = net.output_weight()
    scores = target_log_probs(hidden, weight, layout, targets, rules=net.rules, entropy=entropy)
    log_probs, entropies = scores if entropy else (scores, None)
    return TokenScores(
        targets,
        mask,
        segment_ids,
        log_probs,
        hidden,
        weight,
        layout,
        net.rules,
        positions,
        tokens,
        entropies,
        stats,
    )


def reference_log_probs(
    inputs: StepInputs, model: AbstractModel, params: Any, frozen: Any, policy: TokenScores
) -> jax.Array:
    """fp32 [B, T]: each target's log-probability under the reference (see the module
    docstring), over the rows the policy read."""
    return _reference_target_log_probs(
        inputs,
        model,
        params,
        frozen,
        policy.inputs,
        policy.positions,
        policy.segment_ids,
        policy.targets,
    )


def reference_row_log_probs(
    inputs: StepInputs, model: AbstractModel, params: Any, frozen: Any, rows: jax.Array
) -> jax.Array:
    """fp32 [B, T]: each target of `rows` (tokens [B, seq_len + 1]) under the reference, the
    reference alone run (train.reference_scores scores a dataset so, before training)."""
    tokens, targets, _, segment_ids, positions = inputs.token_format.read(rows)
    return _reference_target_log_probs(
        inputs, model, params, frozen, tokens, positions, segment_ids, targets
    )


def _reference_target_log_probs(
    inputs: StepInputs,
    model: AbstractModel,
    params: Any,
    frozen: Any,
    tokens: jax.Array,
    positions: jax.Array | None,
    segment_ids: jax.Array,
    targets: jax.Array,
) -> jax.Array:
    if model.lora:
        off = jax.tree.map(jnp.zeros_like, params)
        weights = jax.lax.stop_gradient(model.full_params(off, frozen))
    else:
        weights = jax.lax.stop_gradient(frozen)
    reference = merge_model(model, cast_params(model, weights, inputs.compute_dtype))
    hidden = reference.hidden(tokens, positions, segment_ids, in_layout=True)
    weight, layout = reference.output_weight()
    return target_log_probs(hidden, weight, layout, targets, rules=reference.rules)


def with_reference_scores(rows: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Rows of tokens int32 [..., seq_len + 1] and their targets' reference log-probabilities
    float [..., seq_len] → int32 [..., 2 · seq_len + 1], the scores' float32 bits last, so that
    they travel through the step's splits with their row."""
    bits = np.asarray(scores, np.float32).view(np.int32)
    return np.concatenate([np.asarray(rows, np.int32), bits], axis=-1)


def split_reference_scores(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """with_reference_scores' rows, on the device → (tokens int32 [B, seq_len + 1], the
    reference's log-probabilities fp32 [B, seq_len])."""
    seq_len = (rows.shape[-1] - 1) // 2
    return rows[:, : seq_len + 1], jax.lax.bitcast_convert_type(rows[:, seq_len + 1 :], jnp.float32)
