"""Group-relative policy optimisation on scored completions (objective=grpo; docs/rl.md), with
trl's GRPOTrainer's definitions and metric names.

A batch row holds K sampled completions of one prompt (K = 1: the completion after its prompt;
K > 1: the prompt once, each completion a branch after it), and what the loss reads of their
rollout in its last columns (meshtrain.rl.rows; the advantages: meshtrain.rl.advantages); each
target knows its completion (`Completions`). Per completion token t, with log p_t its
log-probability under the policy, old_t under the policy that sampled it and ref_t under the
reference, A the completion's advantage, ε = objective.epsilon, ε_h = objective.epsilon_high
(default ε), β = objective.beta:

  r_t    = exp(log p_t − old_t)                       importance_sampling_level=token
  r_t    = exp(mean over the completion's tokens of (log p − old))      =sequence (GSPO)
  l_t    = −min(r_t·A, clip(r_t, 1 − ε, 1 + ε_h)·A) + β·(exp(ref_t − log p_t) − (ref_t − log p_t) − 1)

With one update per generation (objective.num_iterations = steps_per_generation = 1) the policy
is the sampling policy: old_t = log p_t, so r_t = 1 with the gradient of log p_t. Otherwise the
rows carry old_t, computed when the completions were sampled. The loss of an update, by
objective.loss_type, over its completions and their tokens:

  grpo      the mean over completions of each one's mean over its tokens
  dr_grpo   the sum over every completion token, over completions × objective.max_new_tokens
  dapo      the sum over every completion token, over the completion tokens of the update; of a
            generation that feeds several steps, over its completion tokens / steps_per_generation
            (trl's normalisation)

each a sum over rows and a count that add up over any split of the batch, whatever K. Metrics:
kl (β > 0) and entropy (the policy's, of its prediction at each completion token), means over
the completion tokens; clip_ratio/low_mean (r_t < 1 − ε where A < 0), clip_ratio/high_mean
(r_t > 1 + ε_h where A > 0), clip_ratio/region_mean (either), means over the completion tokens
(token level) or over the completions (sequence level), as trl logs them.
The gradient and the reference: train.objectives.token_scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from meshtrain.config.objective import ObjectiveConfig, generation_cycle, reads_reference
from meshtrain.models.abstract import AbstractModel
from meshtrain.models.attention import BRANCH_SHIFT
from meshtrain.models.lora import AdapterDropout
from meshtrain.rl.rows import RowLayout
from meshtrain.train.gradients import Sums
from meshtrain.train.objectives.base import Objective, StepInputs
from meshtrain.train.objectives.token_scores import policy_scores, reference_log_probs

CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclass(frozen=True)
class Completions:
    """Which of its row's K completions each target belongs to (meshtrain.rl.rows): the branch
    it lies in, or the row's one completion. Targets that carry no loss may land on any."""

    one_hot: jax.Array  # fp32 [B, T, K]

    @classmethod
    def of_rows(cls, segment_ids: jax.Array | None, shape: tuple[int, int], count: int):
        """Of rows [B, T] holding `count` completions each: K = 1, one a row; else the
        completions are the branches 1 … K (segment ids int32 [B, T], models.attention)."""
        if count == 1:
            return cls(jnp.ones((*shape, 1), jnp.float32))
        index = jnp.maximum((segment_ids >> BRANCH_SHIFT) - 1, 0)
        return cls(jax.nn.one_hot(index, count, dtype=jnp.float32))

    @property
    def count(self) -> int:
        """The completions of the rows: B · K."""
        return self.one_hot.shape[0] * self.one_hot.shape[2]

    def sums(self, values: jax.Array) -> jax.Array:
        """values fp32 [B, T] → each completion's sum [B, K]."""
        return jnp.sum(self.one_hot * values[..., None], axis=1)

    def spread(self, values: jax.Array) -> jax.Array:
        """Each completion's value fp32 [B, K] → each of its targets' [B, T]."""
        return jnp.sum(self.one_hot * values[:, None, :], axis=2)


def token_losses(
    log_probs: jax.Array,
    old_log_probs: jax.Array,
    ref_log_probs: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: ObjectiveConfig,
    completions: Completions | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Each token's loss l_t (see the module docstring) from the log-probabilities fp32 [B, T],
    the completions' advantages [B, K] (K completions a row, `completions`, default one) and the
    mask [B, T] (1 where the target carries loss): fp32 [B, T]; and where the ratio was clipped
    below, above, at all (fp32 0/1, [B, T] per token, or [B, K] per completion at the sequence
    level), and the KL per token (when read)."""
    low, high = 1 - cfg.epsilon, 1 + (cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high)
    if completions is None:
        completions = Completions.of_rows(None, mask.shape, 1)
    log_ratio = log_probs - old_log_probs
    advantage = advantages
    if cfg.importance_sampling_level == "sequence":  # one ratio per completion: [B, K]
        tokens = jnp.maximum(completions.sums(mask), 1.0)
        log_ratio = completions.sums(log_ratio * mask) / tokens
    else:
        advantage = completions.spread(advantages)
    ratio = jnp.exp(log_ratio)
    losses = -jnp.minimum(ratio * advantage, jnp.clip(ratio, low, high) * advantage)
    below = ((ratio < low) & (advantage < 0)).astype(jnp.float32)
    above = ((ratio > high) & (advantage > 0)).astype(jnp.float32)
    parts = {
        "clip_ratio/low_mean": below,
        "clip_ratio/high_mean": above,
        "clip_ratio/region_mean": jnp.maximum(below, above),
    }
    if cfg.importance_sampling_level == "sequence":
        losses = completions.spread(losses)
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
    completions: Completions | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The loss sum and count of some rows (losses and mask fp32 [B, T]; K completions a row,
    `completions`, default one) by objective.loss_type, such that the sum over every split of
    an update over its count is the loss of the update. `token_share` (fp32 [B]): each row's
    share of dapo's count, for a generation that feeds several steps (meshtrain.rl.rows)."""
    if completions is None:
        completions = Completions.of_rows(None, mask.shape, 1)
    masked = losses * mask
    count = jnp.asarray(completions.count, jnp.float32)
    if cfg.loss_type == "grpo":
        per_completion = completions.sums(masked) / jnp.maximum(completions.sums(mask), 1.0)
        return jnp.sum(per_completion), count
    if cfg.loss_type == "dr_grpo":
        return jnp.sum(masked) / cfg.max_new_tokens, count
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

    def row_width(self, seq_len: int) -> int:
        return self.layout(seq_len).width

    def layout(self, seq_len: int) -> RowLayout:
        """How its rows hold their completions and rollout (meshtrain.rl.rows)."""
        k = self.inputs.completions_per_row
        return RowLayout.of(seq_len, self.cfg.max_new_tokens, k, self.buffered)

    def sums(
        self,
        model: AbstractModel,
        params: Any,
        rows: Any,
        frozen: Any,
        dropout: AdapterDropout | None = None,
    ) -> Sums:
        k = self.inputs.completions_per_row
        rollout = RowLayout.from_width(rows.shape[-1], k, self.buffered).split(rows)
        policy = policy_scores(
            self.inputs, model, params, frozen, rollout.tokens, dropout, entropy=True
        )
        mask = policy.mask
        completions = Completions.of_rows(policy.segment_ids, mask.shape, k)
        ref = None
        if self.reads_reference:
            ref = reference_log_probs(self.inputs, model, params, frozen, policy)

        def total(log_probs: jax.Array) -> tuple[jax.Array, tuple[jax.Array, dict]]:
            old = rollout.old_log_probs
            if old is None:  # one update per generation: the policy sampled the completions
                old = jax.lax.stop_gradient(log_probs)
            losses, parts = token_losses(
                log_probs, old, ref, rollout.advantages, mask, self.cfg, completions
            )
            loss, count = loss_sum_and_count(
                losses, mask, self.cfg, rollout.token_share, completions
            )
            return loss, (count, parts)

        (loss, (count, parts)), coefficients = jax.value_and_grad(total, has_aux=True)(
            policy.log_probs
        )
        loss = policy.loss_with_gradient(loss, coefficients * mask)
        # Per token, summed over the completion tokens; per completion (sequence-level clip
        # indicators, [B, K]), summed over the completions.
        metric_sums = {
            name: jnp.sum(jax.lax.stop_gradient(part) * (mask if part.shape == mask.shape else 1.0))
            for name, part in parts.items()
        }
        completions_count = jnp.asarray(completions.count, jnp.float32)
        sums = {"loss": loss, "count": count, "tokens": jnp.sum(mask)}
        sums |= {"completions": completions_count}
        sums |= metric_sums | {"entropy": jnp.sum(policy.entropy * mask)}
        return self.with_auxiliary(sums, policy.stats)

    def metrics(self, sums: Sums) -> dict[str, Any]:
        tokens = sums["tokens"]
        tokens = tokens + (tokens == 0)  # no completion token: the metrics are 0, not nan
        per_completion = self.cfg.importance_sampling_level == "sequence"
        return super().metrics(sums) | {
            name: sums[name]
            / (sums["completions"] if per_completion and name in CLIP_METRICS else tokens)
            for name in self.metric_names
        }


def sampling_log_probs(
    inputs: StepInputs, model: AbstractModel
) -> Callable[[Any, Any, jax.Array], jax.Array]:
    """(params, frozen, tokens int32 [accum, rows, T]) → fp32 [accum, rows, T − 1]:
    each target's log-probability under the policy `params` (0 where the target carries no
    loss), a micro-batch at a time as the step reads them. A generation that feeds several
    updates is scored so by the policy that sampled it (its rows' old log-probabilities)."""

    def micro_batch(params: Any, frozen: Any, tokens: jax.Array) -> jax.Array:
        scores = policy_scores(inputs, model, params, frozen, tokens)
        return scores.log_probs * scores.mask

    def score(params: Any, frozen: Any, batch: jax.Array) -> jax.Array:
        return jax.lax.map(lambda tokens: micro_batch(params, frozen, tokens), batch)

    return score
