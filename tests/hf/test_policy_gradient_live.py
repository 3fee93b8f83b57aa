"""objective=grpo's loss and advantages against trl's GRPOTrainer itself (the parity extra): its
`_compute_loss`, run on the same per-token log-probabilities (old and reference ones included)
and advantages, gives the loss, the gradient with respect to each log-probability and the kl
and clip_ratio metrics that meshtrain's loss gives, for every loss type; trl's nanstd is the
std the advantages divide by."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.config.objective import ObjectiveConfig
from meshtrain.rl.advantages import nanstd
from meshtrain.train.objectives.policy_gradient import loss_sum_and_count, token_losses

pytestmark = pytest.mark.slow  # importing trl and torch: about 20 s

EPSILON, EPSILON_HIGH, MAX_NEW = 0.2, 0.28, 10


@pytest.fixture(scope="module")
def trl():
    torch = pytest.importorskip("torch")
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    return SimpleNamespace(
        torch=torch,
        trainer=grpo_trainer.GRPOTrainer,
        utils=pytest.importorskip("trl.trainer.utils"),
    )


def _trl_loss(trl, log_probs, old, ref, advantages, mask, loss_type, beta, level):
    """trl's GRPOTrainer._compute_loss on an object holding only what it reads (evaluation
    mode: no accumulation or process scaling), and the gradient of its loss with respect to
    the per-token log-probabilities."""
    torch = trl.torch
    policy = torch.tensor(log_probs, dtype=torch.float64, requires_grad=True)
    metrics = defaultdict(list)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (policy, torch.zeros_like(policy), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
        loss_type=loss_type,
        epsilon_low=EPSILON,
        epsilon_high=EPSILON_HIGH,
        use_vllm=False,
        model=SimpleNamespace(training=False),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"eval": metrics},
        accelerator=SimpleNamespace(
            reduce=lambda t, reduction: t, gather=lambda t: t, num_processes=1
        ),
        max_completion_length=MAX_NEW,
    )
    rows, length = log_probs.shape
    completion_mask = torch.tensor(mask, dtype=torch.float64)
    inputs = {
        "prompt_ids": torch.ones((rows, 3), dtype=torch.long),
        "prompt_mask": torch.ones((rows, 3), dtype=torch.long),
        "completion_ids": torch.ones((rows, length), dtype=torch.long),
        "completion_mask": completion_mask,
        "advantages": torch.tensor(advantages, dtype=torch.float64),
        "old_per_token_logps": torch.tensor(old, dtype=torch.float64),
        "ref_per_token_logps": torch.tensor(ref, dtype=torch.float64),
        "num_items_in_batch": completion_mask.sum(),
    }
    loss = trl.trainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return float(loss.detach()), policy.grad.numpy(), {k: v[-1] for k, v in metrics.items()}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_loss_its_gradient_and_metrics_are_trls(trl, loss_type, beta, level):
    rng = np.random.default_rng(1)
    rows, length = 6, MAX_NEW
    log_probs = rng.normal(-2.0, 0.5, (rows, length))
    # Ratios on both sides of the clip range, per token and per completion (sequence level).
    old = log_probs + rng.normal(0, 0.3, (rows, length)) + rng.normal(0, 0.3, (rows, 1))
    ref = log_probs + rng.normal(0, 0.2, (rows, length))
    advantages = rng.normal(0, 1, rows)
    mask = (np.arange(length)[None, :] < rng.integers(1, length + 1, rows)[:, None]) * 1.0
    theirs, their_grad, their_metrics = _trl_loss(
        trl, log_probs, old, ref, advantages, mask, loss_type, beta, level
    )

    cfg = ObjectiveConfig(
        name="grpo",
        loss_type=loss_type,
        beta=beta,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        max_new_tokens=MAX_NEW,
        importance_sampling_level=level,
    )
    as32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def loss(lp):
        advantage = as32(advantages)[:, None]  # one completion a row
        losses, parts = token_losses(lp, as32(old), as32(ref), advantage, as32(mask), cfg)
        total, count = loss_sum_and_count(losses, as32(mask), cfg)
        return total / count, parts

    (ours, parts), our_grad = jax.value_and_grad(loss, has_aux=True)(as32(log_probs))
    np.testing.assert_allclose(float(ours), theirs, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(our_grad), their_grad, rtol=1e-4, atol=1e-7)
    for name, value in parts.items():  # per token, or per completion (sequence-level clips)
        mean = float(
            jnp.sum(value * mask) / mask.sum() if value.shape == mask.shape else value.mean()
        )
        np.testing.assert_allclose(mean, their_metrics[name], 1e-5)
    assert ("kl" in parts) == (beta > 0) == ("kl" in their_metrics)
    assert 0 < their_metrics["clip_ratio/region_mean"] < 1  # the clip is exercised


def test_the_std_of_the_advantages_is_trls_nanstd(trl):
    torch, trl_nanstd = trl.torch, trl.utils.nanstd
    rewards = np.array([[1.0, 0.0, np.nan, 3.0], [2.0, 2.0, 2.0, 2.0], [0.5, -1.0, 4.0, 0.0]])
    theirs = trl_nanstd(torch.tensor(rewards), dim=1).numpy()
    np.testing.assert_allclose(nanstd(rewards, axis=1), theirs, rtol=1e-7)  # trl: a float32 step
    theirs_all = float(trl_nanstd(torch.tensor(rewards)))
    np.testing.assert_allclose(nanstd(rewards), theirs_all, rtol=1e-7)
