"""Learning-rate schedule values, weight-decay mask and clipping."""

import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.config import TrainingConfig
from meshtrain.train.optimizer import build_optimizer, decay_mask, learning_rate_schedule


def test_warmup_then_cosine():
    cfg = TrainingConfig(steps=110, warmup_steps=10, learning_rate=1e-3, min_lr_ratio=0.1)
    lr = learning_rate_schedule(cfg)
    assert float(lr(0)) == pytest.approx(1e-4)  # update 1 of 10 warmup updates
    assert float(lr(9)) == pytest.approx(1e-3)  # update 10: the peak
    assert float(lr(59)) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # halfway through the decay
    assert float(lr(109)) == pytest.approx(1e-4)  # last update: the floor


def test_constant_after_warmup():
    lr = learning_rate_schedule(
        TrainingConfig(steps=50, warmup_steps=4, learning_rate=2e-3, lr_schedule="constant")
    )
    np.testing.assert_allclose(
        [float(lr(c)) for c in (0, 1, 3, 4, 49)], [5e-4, 1e-3, 2e-3, 2e-3, 2e-3], rtol=1e-6
    )


def test_weight_decay_spares_norm_scales():
    params = {"w": jnp.ones((2, 2)), "scale": jnp.ones((2,))}
    assert decay_mask(params) == {"w": True, "scale": False}
    tx = build_optimizer(
        TrainingConfig(
            weight_decay=0.5, learning_rate=0.1, warmup_steps=0, grad_clip=0, lr_schedule="constant"
        )
    )
    zero_grads = {"w": jnp.zeros((2, 2)), "scale": jnp.zeros((2,))}
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)
    np.testing.assert_allclose(updates["scale"], np.zeros(2))


def test_global_norm_clipping():
    # With b1 = b2 = 0 and eps = 1, Adam's update is -lr·g/(|g| + 1), which shows g's scale.
    def update(grad_clip):
        tx = build_optimizer(
            TrainingConfig(
                grad_clip=grad_clip,
                learning_rate=1.0,
                warmup_steps=0,
                weight_decay=0.0,
                adam_b1=0.0,
                adam_b2=0.0,
                adam_eps=1.0,
                lr_schedule="constant",
            )
        )
        grads = {"w": jnp.array([3.0, 4.0])}  # global norm 5
        return tx.update(grads, tx.init(grads), grads)[0]["w"]

    np.testing.assert_allclose(
        update(1.0), [-0.6 / 1.6, -0.8 / 1.8], rtol=1e-5
    )  # clipped to norm 1
    np.testing.assert_allclose(update(0.0), [-3.0 / 4.0, -4.0 / 5.0], rtol=1e-5)  # clipping off
