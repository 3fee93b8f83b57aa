"""Decoder-only transformer language model in Flax NNX, configured by `ModelConfig`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.config import ModelConfig
from meshtrain.models.layers import Attention, GatedMLP, RMSNorm, normal_param
from meshtrain.sharding import constrain

ACTIVATIONS = ("silu", "gelu")


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        rules = cfg.logical_axis_rules
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(
            d_model=cfg.d_model,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rope_theta=cfg.rope_theta,
            init_std=cfg.init_std,
            rules=rules,
            rngs=rngs,
        )
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = GatedMLP(
            d_model=cfg.d_model,
            mlp_dim=cfg.mlp_dim,
            activation=cfg.mlp_activation,
            init_std=cfg.init_std,
            rules=rules,
            rngs=rngs,
        )
        self.rules = rules

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions)
        x = constrain(x, ("batch", "length", None), self.rules)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "length", None), self.rules)


class Transformer(nnx.Module):
    """tokens [B, T] int32 → logits [B, T, V] in the compute dtype of the parameters."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.rules = cfg.logical_axis_rules
        self.embed = normal_param(
            rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std
        )
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else normal_param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)
        )

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        embed = self.embed[...]
        dtype = embed.dtype  # the compute dtype: the caller casts the parameters
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = jnp.take(embed, tokens, axis=0)  # [B, T, D]
        x = constrain(x, ("batch", "length", None), self.rules)
        for block in self.blocks:
            x = block(x, positions)
        x = self.final_norm(x)
        if self.lm_head is None:
            logits = jnp.einsum("BTD,VD->BTV", x, embed)
        else:
            logits = jnp.einsum("BTD,DV->BTV", x, self.lm_head[...].astype(dtype))
        return constrain(logits, ("batch", "length", "vocab"), self.rules)
