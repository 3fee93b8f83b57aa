"""One transformer block in Flax NNX (attention and a feed-forward, each a pre-norm residual
branch, optionally sandwich-normed; the feed-forward a gated MLP or a mixture of experts), and the
stacking of blocks for a scan over layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.config.schema import ModelConfig
from meshtrain.models.attention import AttentionKernel, WindowOfKind
from meshtrain.models.layers import Attention, GatedMLP, RMSNorm
from meshtrain.models.lora import AdapterDropout, LoraSpec
from meshtrain.models.moe import MoeFeedForward
from meshtrain.models.routing import MoeStats
from meshtrain.parallel.rules import constrain


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); with post_norms
    (Gemma's sandwich) each branch's output is normalised too before it is added."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        rules = cfg.logical_axis_rules
        lora = LoraSpec.of(cfg)
        norm = dict(eps=cfg.norm_eps, scale_offset=cfg.norm_scale_offset)
        self.attn_norm = RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(
            d_model=cfg.d_model,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            query_pre_attn_scalar=cfg.query_pre_attn_scalar,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            norm_scale_offset=cfg.norm_scale_offset,
            init_std=cfg.init_std,
            rules=rules,
            rngs=rngs,
            lora=lora,
        )
        self.mlp_norm = RMSNorm(cfg.d_model, **norm)
        feed_forward = dict(
            d_model=cfg.d_model,
            activation=cfg.mlp_activation,
            init_std=cfg.init_std,
            rules=rules,
            rngs=rngs,
            lora=lora,
        )
        if cfg.moe.num_experts > 0:
            moe = cfg.moe
            self.mlp = MoeFeedForward(
                expert_dim=moe.expert_dim,
                num_experts=moe.num_experts,
                top_k=moe.top_k,
                score=moe.score,
                normalize_top_k=moe.normalize_top_k,
                capacity_factor=moe.capacity_factor,
                **feed_forward,
            )
        else:
            self.mlp = GatedMLP(mlp_dim=cfg.mlp_dim, **feed_forward)
        if cfg.post_norms:
            self.attn_post_norm = RMSNorm(cfg.d_model, **norm)
            self.mlp_post_norm = RMSNorm(cfg.d_model, **norm)
        else:
            self.attn_post_norm = self.mlp_post_norm = None
        self.rules = rules

    def __call__(
        self,
        x: jax.Array,
        sin: jax.Array,
        cos: jax.Array,
        *,
        kernel: AttentionKernel,
        window: int | WindowOfKind | None = None,
        segment_ids: jax.Array | None = None,
        dropout: AdapterDropout | None = None,
    ) -> tuple[jax.Array, MoeStats | None]:
        """x: [B, T, D] → ([B, T, D], the mixture of experts' routing statistics or None for a
        gated MLP); sin, cos and window of this layer's kind, the adapters' dropout (see
        Attention)."""
        attn = self.attn(
            self.attn_norm(x),
            sin,
            cos,
            kernel=kernel,
            window=window,
            segment_ids=segment_ids,
            dropout=dropout,
        )
        return self.after_attention(x, attn, dropout)

    def after_attention(
        self, x: jax.Array, attn: jax.Array, dropout: AdapterDropout | None = None
    ) -> tuple[jax.Array, MoeStats | None]:
        """The rest of the block, given its input x and the attention's output, both [B, T, D]:
        the residual adds and the feed-forward (the decode path computes the attention its own
        way); with its routing statistics (None for a gated MLP)."""
        if self.attn_post_norm is not None:
            attn = self.attn_post_norm(attn)
        x = constrain(x + attn, ("batch", "length", None), self.rules)
        stats = None
        if isinstance(self.mlp, MoeFeedForward):
            mlp, stats = self.mlp(self.mlp_norm(x), dropout)
        else:
            mlp = self.mlp(self.mlp_norm(x), dropout)
        if self.mlp_post_norm is not None:
            mlp = self.mlp_post_norm(mlp)
        return constrain(x + mlp, ("batch", "length", None), self.rules), stats


def stack_blocks(blocks: list[Block]) -> Block:
    """One Block whose parameters are those of `blocks` stacked on a leading `layers` axis."""
    graphdef = nnx.graphdef(blocks[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
    for variable in jax.tree.leaves(stacked, is_leaf=lambda v: isinstance(v, nnx.Variable)):
        variable.set_metadata(logical_axes=("layers", *variable.get_metadata()["logical_axes"]))
    return nnx.merge(graphdef, stacked)
