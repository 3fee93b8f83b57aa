"""The policy-gradient objective (meshtrain.train.objectives.policy_gradient): the per-token losses
are the published formulas, each loss type's sum and count add up over any split of the rows, and
the objective's loss and gradients over rows of prompts and completions equal the unfused
definition (each completion alone, log_softmax over its whole logits), with and without the KL
to a reference. trl's GRPOTrainer itself: tests/hf/test_policy_gradient_live.py (the parity
extra)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.objectives import FLAGGED, tiny_policy

from meshtrain.config.objective import ObjectiveConfig
from meshtrain.rl.rows import RowLayout
from meshtrain.train.objectives import GroupRelative, StepInputs
from meshtrain.train.objectives.policy_gradient import (
    Completions,
    loss_sum_and_count,
    token_losses,
)

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


def _published(log_probs, old, ref, advantages, mask, cfg, tokens_per_update=None):
    """GRPO's loss written out in float64 numpy, one completion (row) at a time; dapo divides
    by `tokens_per_update` where given (a generation that feeds several updates)."""
    loss_type, beta, max_new = cfg.loss_type, cfg.beta, cfg.max_new_tokens
    low, high = cfg.epsilon, cfg.epsilon_high
    per_row = []
    for lp, o, r, a, m in zip(log_probs, old, ref, advantages, mask, strict=True):
        ratio = np.exp(lp - o)
        if cfg.importance_sampling_level == "sequence":  # GSPO: one ratio per completion
            ratio = np.exp(((lp - o) * m).sum() / max(m.sum(), 1))
        loss = -np.minimum(ratio * a, np.clip(ratio, 1 - low, 1 + high) * a)
        loss = loss + beta * (np.exp(r - lp) - (r - lp) - 1)
        per_row.append((loss * m).sum())
    per_row, tokens = np.array(per_row), mask.sum(axis=1)
    if loss_type == "grpo":
        return np.mean(per_row / np.maximum(tokens, 1))
    if loss_type == "dr_grpo":
        return per_row.sum() / (len(per_row) * max_new)
    return per_row.sum() / (tokens.sum() if tokens_per_update is None else tokens_per_update)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_loss_is_the_published_formula_and_adds_up_over_any_split(loss_type, beta, level):
    rng = np.random.default_rng(0)
    rows, length = 6, 9
    log_probs = rng.normal(-2.0, 0.5, (rows, length))
    old = log_probs + rng.normal(0, 0.3, (rows, length))  # ratios on both sides of the clip range
    ref = log_probs + rng.normal(0, 0.2, (rows, length))
    advantages = rng.normal(0, 1, rows)
    mask = (np.arange(length)[None, :] < rng.integers(1, length + 1, rows)[:, None]) * 1.0
    cfg = ObjectiveConfig(
        name="grpo",
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28,
        max_new_tokens=12,
        importance_sampling_level=level,
    )
    expected = _published(log_probs, old, ref, advantages, mask, cfg)
    # A generation of 3 steps' rows: dapo divides each step's sum by its tokens / 3, spread
    # evenly over a step's rows as token shares (meshtrain.rl.rows).
    generation_tokens = 3 * mask.sum() + 5.0
    share = np.full(rows, generation_tokens / 3 / rows)
    spanning = _published(log_probs, old, ref, advantages, mask, cfg, generation_tokens / 3)

    def loss_of(part: slice, token_share=None, per_row=1):
        """The sum and count of the completions `part`, per_row of them side by side in a row
        (as branches: meshtrain.rl.rows), each row's token share the sum of its completions'."""

        def rows(x):  # [completions, length] → [completions / K, K · length]
            return jnp.asarray(x[part], jnp.float32).reshape(-1, per_row * length)

        # Each target's completion: [K · length, K], the same in every row.
        one_hot = jax.nn.one_hot(np.repeat(np.arange(per_row), length), per_row)
        completions = Completions(jnp.broadcast_to(one_hot, (rows(mask).shape[0], *one_hot.shape)))
        grouped = jnp.asarray(advantages[part], jnp.float32).reshape(-1, per_row)
        losses, _ = token_losses(
            rows(log_probs), rows(old), rows(ref), grouped, rows(mask), cfg, completions
        )
        shares = None
        if token_share is not None:
            shares = jnp.asarray(token_share[part], jnp.float32).reshape(-1, per_row).sum(1)
        return loss_sum_and_count(losses, rows(mask), cfg, shares, completions)

    for token_share, want in ((None, expected), (share, spanning)):
        for per_row in (1, 2):
            whole_sum, whole_count = loss_of(slice(None), token_share, per_row)
            np.testing.assert_allclose(float(whole_sum / whole_count), want, rtol=1e-5)
            halves = [
                loss_of(slice(0, 2), token_share, per_row),
                loss_of(slice(2, None), token_share, per_row),
            ]
            np.testing.assert_allclose(
                float(sum(s for s, _ in halves) / sum(c for _, c in halves)), want, rtol=1e-5
            )
    if loss_type != "dapo":
        assert spanning == expected  # their counts are completions, not tokens


def test_at_the_sequence_level_the_ratio_is_the_completions_mean_log_ratio():
    cfg = ObjectiveConfig(name="grpo", beta=0.0, epsilon=0.2, importance_sampling_level="sequence")
    log_probs = jnp.log(jnp.array([[0.5, 2.0, 9.0, 1.0]], jnp.float32))
    mask = jnp.array([[1.0, 1.0, 0.0, 1.0]])  # the third target carries no loss
    old = jnp.zeros((1, 4), jnp.float32)
    losses, parts = token_losses(log_probs, old, None, jnp.array([[1.0]]), mask, cfg)
    assert parts["clip_ratio/high_mean"].shape == (1, 1)  # one a completion
    np.testing.assert_allclose(losses[0], [-1.0] * 4, rtol=1e-6)  # ratio (0.5·2·1)^(1/3)
    losses, parts = token_losses(
        log_probs, old, None, jnp.array([[-1.0]]), mask.at[0, 1].set(0), cfg
    )
    np.testing.assert_allclose(losses[0], [0.8] * 4, rtol=1e-6)  # √0.5 = 0.707, clipped
    assert float(parts["clip_ratio/low_mean"][0, 0]) == 1.0


def test_the_clip_metrics_count_the_tokens_outside_the_range_on_the_advantages_side():
    cfg = ObjectiveConfig(name="grpo", beta=0.0, epsilon=0.2, epsilon_high=0.3)
    log_probs = jnp.log(jnp.array([[0.7, 1.0, 1.35, 0.5]], jnp.float32))  # ratios to old = 1
    old = jnp.zeros((1, 4), jnp.float32)
    for advantage, low, high in ((-1.0, [1, 0, 0, 1], [0] * 4), (1.0, [0] * 4, [0, 0, 1, 0])):
        _, parts = token_losses(
            log_probs, old, None, jnp.array([[advantage]]), jnp.ones((1, 4)), cfg
        )
        np.testing.assert_array_equal(parts["clip_ratio/low_mean"][0], low)
        np.testing.assert_array_equal(parts["clip_ratio/high_mean"][0], high)
        region = np.maximum(low, high)
        np.testing.assert_array_equal(parts["clip_ratio/region_mean"][0], region)
    assert "kl" not in parts


LENGTH = 25  # seq_len + 1
# (prompt tokens, completion tokens) of each completion, two of each prompt (a group of 2): one
# completion a row, or both completions of a prompt in a row of 40 tokens (RowLayout).
ROWS = [(4, 7), (4, 12), (6, 2), (6, 9)]


def completion_log_probs(policy, weights, ids, prompt):
    """[LENGTH - 1]: each completion target's log-probability, the sequence alone, and the
    completion's mask."""
    positions = np.arange(LENGTH - 1)
    mask = ((positions >= prompt - 1) & (positions < len(ids) - 1)).astype(np.float32)
    return policy.log_probs_alone(weights, ids, LENGTH) * mask, mask


def _rows(rng, layout):
    """Rows [4 / K, T] (meshtrain.rl.rows' `layout`) and each completion's (ids, prompt length)
    alone."""
    prompts = [rng.integers(1, 300, p).astype(np.int32) for p, _ in ROWS[::2]]
    prompts = [prompt for prompt in prompts for _ in range(2)]
    completions = [rng.integers(1, 300, c).astype(np.int32) for _, c in ROWS]
    rows = layout.token_rows(prompts, completions, np.ones(len(ROWS), bool))
    sequences = [(np.concatenate(pc), len(pc[0])) for pc in zip(prompts, completions, strict=True)]
    return rows, sequences


def _in_rows(alone, layout):
    """Each completion's targets alone [4, LENGTH - 1] → where its row holds them [4 / K, T - 1]."""
    k = layout.completions
    rows = np.zeros((len(ROWS) // k, layout.tokens - 1), np.float32)
    for index, (values, (prompt, completion)) in enumerate(zip(alone, ROWS, strict=True)):
        if index % k == 0:
            at = prompt - 1  # the target of the prompt's last token: the completion's first
        rows[index // k, at : at + completion] = values[prompt - 1 : prompt - 1 + completion]
        at += completion + 1  # the next branch's opening token, then its completion
    return rows


@pytest.mark.parametrize(
    ("loss_type", "beta", "iterations", "level", "per_row"),
    [
        ("grpo", 0.0, 1, "token", 1),
        ("dapo", 0.04, 1, "token", 1),
        ("dapo", 0.0, 2, "token", 1),
        ("grpo", 0.04, 1, "token", 2),
        ("dapo", 0.0, 2, "token", 2),
        ("grpo", 0.0, 2, "sequence", 2),
    ],
)
@pytest.mark.slow
def test_the_loss_and_gradients_of_rows_are_those_of_each_completion_alone(
    loss_type, beta, iterations, level, per_row
):
    policy = tiny_policy()
    params, reference = policy.params, policy.reference
    rng = np.random.default_rng(0)
    layout = RowLayout(LENGTH if per_row == 1 else 40, per_row, buffered=iterations > 1)
    tokens, sequences = _rows(rng, layout)
    advantages = np.array([1.2, -0.4, 0.0, -0.8], np.float32)
    objective_cfg = ObjectiveConfig(
        name="grpo",
        loss_type=loss_type,
        beta=beta,
        reference="initial" if beta else "none",
        num_iterations=iterations,
        importance_sampling_level=level,
    )
    inputs = StepInputs(FLAGGED, jnp.float32, completions_per_row=per_row)
    objective = GroupRelative(inputs, objective_cfg)
    # With 2 updates a generation the rows carry the sampling policy's log-probabilities:
    # here the policy's own, moved far enough that some ratios leave the clip range.
    old = None
    grouped = advantages.reshape(-1, per_row)
    if iterations > 1:
        old = np.stack([completion_log_probs(policy, params, ids, p)[0] for ids, p in sequences])
        old = old + rng.normal(0, 0.4, old.shape).astype(np.float32) * (old != 0)
        # 40 tokens per step in the generation: 10 a completion
        share = np.full(len(ROWS) // per_row, 10.0 * per_row, np.float32)
        rows = layout.with_rollout(tokens, grouped, share, _in_rows(old, layout))
    else:
        rows = layout.with_rollout(tokens, grouped)
    sums, grads = jax.jit(objective.loss_and_grads(policy.model))(params, rows, reference)

    def definition(weights):
        scored = [completion_log_probs(policy, weights, ids, prompt) for ids, prompt in sequences]
        log_probs = jnp.stack([lp for lp, _ in scored])
        mask = jnp.stack([m for _, m in scored])
        ref = None
        if beta:
            ref = jnp.stack(
                [completion_log_probs(policy, reference, i, p)[0] for i, p in sequences]
            )
        sampled = jax.lax.stop_gradient(log_probs) if old is None else jnp.asarray(old)
        losses, _ = token_losses(
            log_probs, sampled, ref, jnp.asarray(advantages)[:, None], mask, objective_cfg
        )
        loss, count = loss_sum_and_count(losses, mask, objective_cfg)
        return loss / (40.0 if old is not None and loss_type == "dapo" else count)

    expected, expected_grads = jax.value_and_grad(definition)(params)
    completions = sum(c for _, c in ROWS)
    assert float(sums["tokens"]) == completions
    dapo_count = completions if old is None else 40.0
    assert float(sums["count"]) == (dapo_count if loss_type == "dapo" else len(ROWS))
    count = float(sums["count"])
    np.testing.assert_allclose(sums["loss"] / count, expected, rtol=1e-5)
    for ours, theirs in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(ours / count, theirs, rtol=1e-4, atol=2e-7)
    metrics = objective.metrics(sums)
    # trl's entropy: the policy's, of its prediction at each completion token, their mean.
    entropies = [policy.entropies_alone(params, ids, LENGTH) for ids, _ in sequences]
    masks = [completion_log_probs(policy, params, ids, p)[1] for ids, p in sequences]
    expected_entropy = sum(float(np.sum(e * m)) for e, m in zip(entropies, masks, strict=True))
    np.testing.assert_allclose(metrics["entropy"], expected_entropy / completions, rtol=1e-5)
    if old is None:
        assert metrics["clip_ratio/region_mean"] == 0.0  # one update per rollout: the ratio is 1
    elif level == "token":
        assert 0 < metrics["clip_ratio/region_mean"] < 1
    else:  # the share of completions whose one ratio left the range on its advantage's side
        log_probs = np.stack([completion_log_probs(policy, params, i, p)[0] for i, p in sequences])
        ratio = np.exp(np.sum(log_probs - old, axis=1) / np.sum(masks, axis=1))
        clipped = ((ratio < 0.8) & (advantages < 0)) | ((ratio > 1.2) & (advantages > 0))
        np.testing.assert_allclose(metrics["clip_ratio/region_mean"], np.mean(clipped))
    if beta:
        assert float(metrics["kl"]) > 0
