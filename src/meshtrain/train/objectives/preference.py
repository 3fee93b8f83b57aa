"""Preference optimisation on pairs of answers (objective=dpo; docs/preference.md): DPO and its
kin, with trl's DPOTrainer's definitions and metric names.

A batch row packs whole pairs (meshtrain.data.chat.pairs): each a document whose branches 1 and 2
are the chosen and rejected answers after the prompt (data.shared_prompt), or two documents,
prompt + chosen then prompt + rejected; the targets that carry loss are the answers' tokens. For
each sequence, its log-probability under the policy is the sum of its answer tokens'
log-probabilities (logps/chosen, logps/rejected), and under the reference likewise.
With Δ = (logp_c − ref_c) − (logp_r − ref_r) and β = objective.beta, per pair:

  sigmoid   −(1−ε)·logσ(βΔ) − ε·logσ(−βΔ)            (DPO; ε = label_smoothing: conservative DPO)
  robust    (−(1−ε)·logσ(βΔ) + ε·logσ(−βΔ)) / (1−2ε)   (robust DPO)
  hinge     relu(1 − βΔ)                             (SLiC)
  ipo       (Δ' − 1/(2β))², Δ' with each sequence's log-ratio over its answer's length (IPO,
            length-normalised as trl normalises it)
  simpo     −(1−ε)·logσ(βδ − γ) − ε·logσ(−βδ + γ), δ = avg logp_c − avg logp_r over each
            answer's tokens; no reference (SimPO, trl's CPO with loss_type=simpo, cpo_alpha=0)

The loss of an update is the mean over its pairs (the sum over every micro-batch and device,
over the count of pairs), so it does not depend on the split of the batch. The metrics, means
over the pairs: rewards/chosen = β·(logp_c − ref_c) (SimPO: β·avg logp_c), rewards/rejected,
rewards/accuracies (chosen reward above rejected), rewards/margins, logps/chosen, logps/rejected.

The gradient and the reference: train.objectives.token_scores (the loss is a function of the
answers' log-probabilities; the reference runs forward only). With objective.reference=
precomputed the reference does not run in the step: each row carries its targets' reference
log-probabilities after its tokens (seq_len more columns, fp32 bits; train.reference_scores).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from meshtrain.config.objective import ObjectiveConfig, precomputed_reference, reads_reference
from meshtrain.models.abstract import AbstractModel
from meshtrain.models.attention import BRANCH_SHIFT, DOCUMENT_BITS
from meshtrain.models.lora import AdapterDropout
from meshtrain.train.gradients import Sums
from meshtrain.train.objectives.base import Objective, StepInputs
from meshtrain.train.objectives.token_scores import (
    policy_scores,
    reference_log_probs,
    split_reference_scores,
)

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def pair_loss(
    chosen: jax.Array,
    rejected: jax.Array,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    chosen_tokens: jax.Array,
    rejected_tokens: jax.Array,
    cfg: ObjectiveConfig,
) -> jax.Array:
    """Each pair's loss (see the module docstring) from its sequences' summed log-probabilities
    and answer lengths, all fp32 [P]."""
    beta, smoothing = cfg.beta, cfg.label_smoothing
    if cfg.loss_type == "simpo":
        delta = beta * (chosen / chosen_tokens - rejected / rejected_tokens) - cfg.gamma
        return -(1 - smoothing) * jax.nn.log_sigmoid(delta) - smoothing * jax.nn.log_sigmoid(-delta)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if cfg.loss_type == "ipo":
        delta = chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens
        return (delta - 1 / (2 * beta)) ** 2
    delta = beta * (chosen_ratio - rejected_ratio)
    if cfg.loss_type == "hinge":
        return jax.nn.relu(1 - delta)
    clean, flipped = jax.nn.log_sigmoid(delta), jax.nn.log_sigmoid(-delta)
    if cfg.loss_type == "robust":
        return (-(1 - smoothing) * clean + smoothing * flipped) / (1 - 2 * smoothing)
    return -(1 - smoothing) * clean - smoothing * flipped  # sigmoid


def answer_sequences(segment_ids: jax.Array) -> jax.Array:
    """int32 [B, T]: each token's sequence among its row's pairs, 2p - 1 for the p-th pair's
    chosen answer and 2p for its rejected one, from segment ids int32 [B, T]: a pair's branches 1
    and 2 (shared prompt), or its two documents. A shared prompt's tokens (branch 0) land on the
    pair's document number; they carry no loss, so every sum over them is 0."""
    document, branch = segment_ids & DOCUMENT_BITS, segment_ids >> BRANCH_SHIFT
    return jnp.where(branch > 0, 2 * document - 2 + branch, document)


def sequence_sums(values: jax.Array, sequences: jax.Array) -> jax.Array:
    """values fp32 [B, T] summed per sequence of each row: [B, T + 1], column s the sum over
    the tokens of sequence s (sequences count from 1; at most T in a row)."""
    batch, length = values.shape
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
    return jnp.zeros((batch, length + 1), values.dtype).at[rows, sequences].add(values)


class Preference(Objective):
    """objective=dpo: see the module docstring."""

    name = "dpo"
    metric_names = METRICS

    def __init__(self, inputs: StepInputs, cfg: ObjectiveConfig) -> None:
        super().__init__(inputs, cfg)
        self.against_reference = reads_reference(cfg)
        self.precomputed = precomputed_reference(cfg)
        # Only a reference computed in the step reads the state's frozen copy.
        self.reads_reference = self.against_reference and not self.precomputed

    def row_width(self, seq_len: int) -> int:
        # The reference's log-probability of each target after the tokens, if precomputed.
        return 2 * seq_len + 1 if self.precomputed else seq_len + 1

    def sums(
        self,
        model: AbstractModel,
        params: Any,
        rows: Any,
        frozen: Any,
        dropout: AdapterDropout | None = None,
    ) -> Sums:
        ref_log_probs = None
        if self.precomputed:
            rows, ref_log_probs = split_reference_scores(rows)
        policy = policy_scores(self.inputs, model, params, frozen, rows, dropout)
        mask, sequences = policy.mask, answer_sequences(policy.segment_ids)
        if self.reads_reference:
            ref_log_probs = reference_log_probs(self.inputs, model, params, frozen, policy)
        elif ref_log_probs is None:
            ref_log_probs = jnp.zeros_like(policy.log_probs)

        def pairs(per_token: jax.Array) -> tuple[jax.Array, jax.Array]:
            """[B, T] → the chosen and rejected sequences' sums over their answer tokens, each
            [B · P] (P = T // 2 + 1 pairs a row can hold at most)."""
            per_sequence = sequence_sums(per_token * mask, sequences)  # [B, T + 1]
            chosen, rejected = per_sequence[:, 1::2], per_sequence[:, 2::2]
            count = rejected.shape[1]
            return chosen[:, :count].reshape(-1), rejected.reshape(-1)

        chosen_tokens, rejected_tokens = pairs(jnp.ones_like(mask))
        valid = (chosen_tokens > 0) & (rejected_tokens > 0)  # both answers have tokens
        chosen_tokens = jnp.maximum(chosen_tokens, 1.0)
        rejected_tokens = jnp.maximum(rejected_tokens, 1.0)
        ref_chosen, ref_rejected = pairs(ref_log_probs)

        def total(chosen: jax.Array, rejected: jax.Array) -> jax.Array:
            losses = pair_loss(
                chosen,
                rejected,
                ref_chosen,
                ref_rejected,
                chosen_tokens,
                rejected_tokens,
                self.cfg,
            )
            return jnp.sum(jnp.where(valid, losses, 0.0))

        chosen, rejected = pairs(policy.log_probs)
        loss, (d_chosen, d_rejected) = jax.value_and_grad(total, argnums=(0, 1))(chosen, rejected)
        # Each answer token's coefficient is ∂loss/∂logp of its sequence.
        per_sequence = jnp.zeros((mask.shape[0], mask.shape[1] + 1), jnp.float32)
        per_sequence = per_sequence.at[:, 1::2].set(
            _padded(d_chosen.reshape(mask.shape[0], -1), per_sequence[:, 1::2].shape[1])
        )
        per_sequence = per_sequence.at[:, 2::2].set(d_rejected.reshape(mask.shape[0], -1))
        coefficients = jnp.take_along_axis(per_sequence, sequences, axis=1) * mask
        loss = policy.loss_with_gradient(loss, coefficients)
        sums = {"loss": loss, "count": jnp.sum(valid, dtype=jnp.float32)} | self._metric_sums(
            chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, valid
        )
        return self.with_auxiliary(sums, policy.stats)

    def _metric_sums(
        self,
        chosen: jax.Array,
        rejected: jax.Array,
        ref_chosen: jax.Array,
        ref_rejected: jax.Array,
        chosen_tokens: jax.Array,
        rejected_tokens: jax.Array,
        valid: jax.Array,
    ) -> Sums:
        beta = self.cfg.beta
        if self.against_reference:
            chosen_reward = beta * (chosen - ref_chosen)
            rejected_reward = beta * (rejected - ref_rejected)
            chosen_logps, rejected_logps = chosen, rejected
        else:  # SimPO: length-normalised log-probabilities, as trl's CPO logs them
            chosen_logps, rejected_logps = chosen / chosen_tokens, rejected / rejected_tokens
            chosen_reward, rejected_reward = beta * chosen_logps, beta * rejected_logps
        values = (
            chosen_reward,
            rejected_reward,
            (chosen_reward > rejected_reward).astype(jnp.float32),
            chosen_reward - rejected_reward,
            chosen_logps,
            rejected_logps,
        )
        return {
            name: jnp.sum(jnp.where(valid, jax.lax.stop_gradient(v), 0.0))
            for name, v in zip(METRICS, values, strict=True)
        }

    def metrics(self, sums: Sums) -> dict[str, Any]:
        count = sums["count"]
        return super().metrics(sums) | {name: sums[name] / count for name in METRICS}


def _padded(values: jax.Array, width: int) -> jax.Array:
    """[B, n] → [B, width], zeros after."""
    return jnp.pad(values, ((0, 0), (0, width - values.shape[1])))
