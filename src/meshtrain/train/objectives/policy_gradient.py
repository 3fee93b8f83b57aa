"""Group-relative policy optimisation on scored completions (objective=grpo; docs/rl.md), with
trl's GRPOTrainer's definitions and metric names.

A batch row holds one sampled completion after its prompt, and what the loss reads of its rollout
in its last columns (meshtrain.rl.rows; the advantages: meshtrain.rl.advantages). Per completion
token t, with log p_t its log-probability under the policy, old_t under the policy that sampled
it and ref_t under the reference, A the completion's advantage, ε = objective.epsilon,
ε_h = objective.epsilon_high (default ε), β = objective.beta:

  r_t    = exp(log p_t − old_t)                       importance_sampling_level=token
  r_t    = exp(mean over the completion's tokens of (log p − old))      =sequence (GSPO)
  l_t    = −min(r_t·A, clip(r_t, 1 − ε, 1 + ε_h)·A) + β·(exp(ref_t − log p_t) − (ref_t − log p_t) − 1)

With one update per generation (objective.num_iterations = steps_per_generation = 1) the policy
is the sampling policy: old_t = log p_t, so r_t = 1 with the gradient of log p_t. Otherwise the
rows carry old_t, computed when the completions were sampled. The loss of an update, by
objective.loss_type, over its completions (rows) and their tokens:

  grpo      the mean over completions of each one's mean over its tokens
  dr_grpo   the sum over every completion token, over completions × objective.max_new_tokens
  dapo      the sum over every completion token, over the completion tokens of the update; of a
            generation that feeds several steps, over its completion tokens / steps_per_generation
            (trl's normalisation)

each a sum over rows and a count that add up over any split of the batch. Metrics: kl (β > 0)
and entropy (the policy's, of its prediction at each completion token), means over the
completion tokens; clip_ratio/low_mean (r_t < 1 − ε where A < 0),
clip_ratio/high_mean (r_t > 1 + ε_h where A > 0), clip_ratio/region_mean (either), means over
the completion tokens (token level) or over the completions (sequence level), as trl logs them.
The gradient and the reference: train.objectives.token_scores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from meshtrain.config.objective import ObjectiveConfig, generation_cycle, reads_reference
from meshtrain.models.abstract import AbstractModel
from meshtrain.models.lora import AdapterDropout
from meshtrain.rl.rows import rollout_columns, split_rollout
from meshtrain.train.gradients import Sums
from meshtrain.train.objectives.base import Objective, StepInputs
from meshtrain.train.objectives.token_scores import policy_scores, reference_log_probs

CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def token_losses(
    log_probs: jax.Array,
    old_log_probs: jax.Array,
    ref_log_probs: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: ObjectiveConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Each token's loss l_t (see the module docstring) from the log-probabilities fp32 [B, T],
    the advantages [B] and the mask [B, T] (1 where the target carries loss): fp32 [B, T], or
    [B, 1] at the sequence level without a reference; and where the ratio was clipped below,
    above, at all (fp32 0/1, [B, T] or [B, 1] per completion), and the KL per token (when read)."""
    low, high = 1 - cfg.epsilon, 1 + (cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high)
    advantage = advantages[:, None]
    log_ratio = log_probs - old_log_probs
    if cfg.importance_sampling_level == "sequence":
        tokens = jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0)
        log_ratio = jnp.sum(log_ratio * mask, axis=1, keepdims=True) / tokens
    ratio = jnp.exp(log_ratio)
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
    losses: jax.Array,
    mask: jax.Array,
    cfg: ObjectiveConfig,
    token_share: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The loss sum and count of some rows (losses fp32 [B, T] or [B, 1], mask fp32 [B, T];
    one completion a row) by objective.loss_type, such that the sum over every split of an
    update over its count is the loss of the update. `token_share` (fp32 [B]): each row's
    share of dapo's count, for a generation that feeds several steps (meshtrain.rl.rows)."""
    masked = losses * mask
    rows = jnp.asarray(losses.shape[0], jnp.float32)
    if cfg.loss_type == "grpo":
        per_row = jnp.sum(masked, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return jnp.sum(per_row), rows
    if cfg.loss_type == "dr_grpo":
        return jnp.sum(masked) / cfg.max_new_tokens, rows
    count = jnp.sum(mask) if token_share is None else jnp.sum(token_share)
    return jnp.sum(masked), count  # dapo


class GroupRelative(Objective):
    """objective=grpo: see the module docstring."""

    name = "grpo"

    def __init__(self, inputs: StepInputs, cfg: ObjectiveConfig) -> None:
        super().__init__(inputs, cfg)
        self.reads_reference = reads_reference(cfg)
        self.buffered = generation_cycle(cfg) > 1  # the rows carry the sampling policy's scores
        self.metric_names = (*(("kl",) if self.reads_reference else ()), "entropy", *CLIP_METRICS)

    def extra_columns(self, seq_len: int) -> int:
        return rollout_columns(seq_len, buffered=self.buffered)

    def sums(
        self,
        model: AbstractModel,
        params: Any,
        rows: Any,
        frozen: Any,
        dropout: AdapterDropout | None = None,
    ) -> Sums:
        rollout = split_rollout(rows, buffered=self.buffered)
        policy = policy_scores(
            self.inputs, model, params, frozen, rollout.tokens, dropout, entropy=True
        )
        mask = policy.mask
        ref = None
        if self.reads_reference:
            ref = reference_log_probs(self.inputs, model, params, frozen, policy)

        def total(log_probs: jax.Array) -> tuple[jax.Array, tuple[jax.Array, dict]]:
            old = rollout.old_log_probs
            if old is None:  # one update per generation: the policy sampled the completions
                old = jax.lax.stop_gradient(log_probs)
            losses, parts = token_losses(log_probs, old, ref, rollout.advantages, mask, self.cfg)
            loss, count = loss_sum_and_count(losses, mask, self.cfg, rollout.token_share)
            return loss, (count, parts)

        (loss, (count, parts)), coefficients = jax.value_and_grad(total, has_aux=True)(
            policy.log_probs
        )
        loss = policy.loss_with_gradient(loss, coefficients * mask)
        # Per token, summed over the completion tokens; per completion (sequence-level clip
        # indicators, [B, 1]), summed over the completions.
        metric_sums = {
            name: jnp.sum(jax.lax.stop_gradient(part) * (mask if part.shape == mask.shape else 1.0))
            for name, part in parts.items()
        }
        rows_count = jnp.asarray(mask.shape[0], jnp.float32)
        sums = {"loss": loss, "count": count, "tokens": jnp.sum(mask), "rows": rows_count}
        sums |= metric_sums | {"entropy": jnp.sum(policy.entropy * mask)}
        return self.with_auxiliary(sums, policy.stats)

    def metrics(self, sums: Sums) -> dict[str, Any]:
        tokens = sums["tokens"]
        tokens = tokens + (tokens == 0)  # no completion token: the metrics are 0, not nan
        per_completion = self.cfg.importance_sampling_level == "sequence"
        return super().metrics(sums) | {
            name: sums[name] / (sums["rows"] if per_completion and name in CLIP_METRICS else tokens)
            for name in self.metric_names
        }


def sampling_log_probs(
    inputs: StepInputs, model: AbstractModel
) -> Callable[[Any, Any, jax.Array], jax.Array]:
    """(params, frozen, tokens int32 [accum, micro, seq_len + 1]) → fp32 [accum, micro, seq_len]:
    each target's log-probability under the policy `params` (0 where the target carries no
    loss), a micro-batch at a time as the step reads them. A generation that feeds several
    updates is scored so by the policy that sampled it (its rows' old log-probabilities)."""

    def micro_batch(params: Any, frozen: Any, tokens: jax.Array) -> jax.Array:
        scores = policy_scores(inputs, model, params, frozen, tokens)
        return scores.log_probs * scores.mask

    def score(params: Any, frozen: Any, batch: jax.Array) -> jax.Array:
        return jax.lax.map(lambda tokens: micro_batch(params, frozen, tokens), batch)

    return score
