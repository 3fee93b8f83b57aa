"""Group-relative policy optimisation on scored completions (objective=grpo; docs/rl.md), with
trl's GRPOTrainer's definitions and metric names.

A batch row holds one sampled completion after its prompt, and the completion's advantage in
its last column (meshtrain.rl.rows; the advantages: meshtrain.rl.advantages). Per completion
token t, with log p_t its log-probability under the policy, old_t under the policy that sampled
it and ref_t under the reference, A the completion's advantage, ε = objective.epsilon,
ε_h = objective.epsilon_high (default ε), β = objective.beta:

  r_t    = exp(log p_t − old_t)
  l_t    = −min(r_t·A, clip(r_t, 1 − ε, 1 + ε_h)·A) + β·(exp(ref_t − log p_t) − (ref_t − log p_t) − 1)

One update per rollout (old_t = log p_t, so r_t = 1 with the gradient of log p_t). The loss of
an update, by objective.loss_type, over its completions (rows) and their tokens:

  grpo      the mean over completions of each one's mean over its tokens
  dr_grpo   the sum over every completion token, over completions × objective.max_new_tokens
  dapo      the mean over every completion token

each a sum over rows and a count that add up over any split of the batch. Metrics, means over the
completion tokens: kl (β > 0), clip_ratio/low_mean (r_t < 1 − ε where A < 0),
clip_ratio/high_mean (r_t > 1 + ε_h where A > 0), clip_ratio/region_mean (either). The gradient
and the reference: train.objectives.token_scores.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from meshtrain.config.objective import ObjectiveConfig, reads_reference
from meshtrain.models.abstract import AbstractModel
from meshtrain.models.lora import AdapterDropout
from meshtrain.rl.rows import split_advantages
from meshtrain.train.gradients import Sums
from meshtrain.train.objectives.base import Objective, StepInputs
from meshtrain.train.objectives.token_scores import policy_scores, reference_log_probs

CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def token_losses(
    log_probs: jax.Array,
    old_log_probs: jax.Array,
    ref_log_probs: jax.Array | None,
    advantages: jax.Array,
    cfg: ObjectiveConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Each token's loss l_t (see the module docstring), fp32 [B, T] from the log-probabilities
    [B, T] and the advantages [B]; and per token the KL (when read) and where the ratio was
    clipped below, above, at all (fp32 0/1)."""
    low, high = 1 - cfg.epsilon, 1 + (cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high)
    advantage = advantages[:, None]
    ratio = jnp.exp(log_probs - old_log_probs)
    losses = -jnp.minimum(ratio * advantage, jnp.clip(ratio, low, high) * advantage)
    below = ((ratio < low) & (advantage < 0)).astype(jnp.float32)
    above = ((ratio > high) & (advantage > 0)).astype(jnp.float32)
    parts = {
        "clip_ratio/low_mean": below,
        "clip_ratio/high_mean": above,
        "clip_ratio/region_mean": jnp.maximum(below, above),
    }
    if ref_log_probs is not None and cfg.beta:
        gap = ref_log_probs - log_probs
        parts["kl"] = jnp.exp(gap) - gap - 1
        losses = losses + cfg.beta * parts["kl"]
    return losses, parts


def loss_sum_and_count(
    losses: jax.Array, mask: jax.Array, cfg: ObjectiveConfig
) -> tuple[jax.Array, jax.Array]:
    """The loss sum and count of some rows (losses, mask fp32 [B, T]; one completion a row) by
    objective.loss_type, such that the sum over every split of an update over its count is the
    loss of the update."""
    masked = losses * mask
    rows = jnp.asarray(losses.shape[0], jnp.float32)
    if cfg.loss_type == "grpo":
        per_row = jnp.sum(masked, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return jnp.sum(per_row), rows
    if cfg.loss_type == "dr_grpo":
        return jnp.sum(masked) / cfg.max_new_tokens, rows
    return jnp.sum(masked), jnp.sum(mask)  # dapo


class GroupRelative(Objective):
    """objective=grpo: see the module docstring."""

    name = "grpo"

    def __init__(self, inputs: StepInputs, cfg: ObjectiveConfig) -> None:
        super().__init__(inputs, cfg)
        self.reads_reference = reads_reference(cfg)
        self.metric_names = (*(("kl",) if self.reads_reference else ()), *CLIP_METRICS)

    def extra_columns(self, seq_len: int) -> int:
        return 1  # the advantage (meshtrain.rl.rows)

    def sums(
        self,
        model: AbstractModel,
        params: Any,
        rows: Any,
        frozen: Any,
        dropout: AdapterDropout | None = None,
    ) -> Sums:
        tokens, advantages = split_advantages(rows)
        policy = policy_scores(self.inputs, model, params, frozen, tokens, dropout)
        mask = policy.mask
        ref = None
        if self.reads_reference:
            ref = reference_log_probs(self.inputs, model, params, frozen, policy)

        def total(log_probs: jax.Array) -> tuple[jax.Array, tuple[jax.Array, dict]]:
            old = jax.lax.stop_gradient(log_probs)  # one update per rollout
            losses, parts = token_losses(log_probs, old, ref, advantages, self.cfg)
            loss, count = loss_sum_and_count(losses, mask, self.cfg)
            return loss, (count, parts)

        (loss, (count, parts)), coefficients = jax.value_and_grad(total, has_aux=True)(
            policy.log_probs
        )
        loss = policy.loss_with_gradient(loss, coefficients * mask)
        metric_sums = {name: jnp.sum(jax.lax.stop_gradient(parts[name]) * mask) for name in parts}
        return {"loss": loss, "count": count, "tokens": jnp.sum(mask)} | metric_sums

    def metrics(self, sums: Sums) -> dict[str, Any]:
        tokens = sums["tokens"]
        tokens = tokens + (tokens == 0)  # no completion token: the metrics are 0, not nan
        return super().metrics(sums) | {name: sums[name] / tokens for name in self.metric_names}
