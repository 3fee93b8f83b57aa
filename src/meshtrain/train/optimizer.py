"""AdamW with linear warmup then cosine (or constant) learning rate, and global-norm clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from meshtrain.config import TrainingConfig


def learning_rate_schedule(cfg: TrainingConfig) -> optax.Schedule:
    """Learning rate of the update with 0-based index `count` (logged as step count + 1).

    Warmup rises linearly and reaches the peak at update `warmup_steps` (so the first update
    already moves the weights); cosine then falls to min_lr_ratio × peak at the last update.
    """
    peak, warmup, total = cfg.learning_rate, cfg.warmup_steps, cfg.steps

    def schedule(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, jnp.float32) + 1.0  # 1-based update number
        warm = peak * jnp.minimum(1.0, step / max(warmup, 1))
        if cfg.lr_schedule == "constant":
            return warm
        progress = jnp.clip((step - warmup) / max(total - warmup, 1), 0.0, 1.0)
        floor = peak * cfg.min_lr_ratio
        cosine = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step <= warmup, warm, cosine)

    return schedule


def decay_mask(params):
    """Weight decay on matrices only: norms' scales are left alone. They are 1-D, or [layers, dim]
    when model.scan_layers stacks the blocks, and always named `scale`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim >= 2 and getattr(path[-1], "key", None) != "scale", params
    )


def build_optimizer(cfg: TrainingConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(cfg),
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw
