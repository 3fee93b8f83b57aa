"""Transformer building blocks in Flax NNX; every parameter carries its logical axis names.

Dimension letters in einsum strings: B batch, T query length, S key length, D model (embed),
N query heads, K key/value heads, G query heads per key/value head, H head_dim, F mlp hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.sharding import Rules, constrain


def normal_param(
    rngs: nnx.Rngs, shape: Sequence[int], logical_axes: Sequence[str], std: float
) -> nnx.Param:
    return nnx.Param(
        std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32),
        logical_axes=tuple(logical_axes),
    )


class RMSNorm(nnx.Module):
    """Root-mean-square norm (https://arxiv.org/abs/1910.07467), computed in fp32."""

    def __init__(self, dim: int, *, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x.dtype)


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (https://arxiv.org/abs/2104.09864), "rotate half" layout as in
    Llama and Hugging Face: dimension i pairs with i + head_dim/2.

    x: [B, T, heads, H]; positions: [B, T].
    """
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    sin = jnp.sin(angles)[:, :, None, :]  # [B, T, 1, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention: K key/value heads, each shared by G = N/K query heads."""

    def __init__(
        self,
        *,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float,
        init_std: float,
        rules: Rules,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.rules = rules
        self.q = normal_param(
            rngs, (d_model, num_heads, head_dim), ("embed", "heads", "head_dim"), init_std
        )
        self.k = normal_param(
            rngs, (d_model, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), init_std
        )
        self.v = normal_param(
            rngs, (d_model, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), init_std
        )
        self.o = normal_param(
            rngs, (num_heads, head_dim, d_model), ("heads", "head_dim", "embed"), init_std
        )

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x: [B, T, D] → [B, T, D]."""
        dtype = x.dtype
        q = jnp.einsum("BTD,DNH->BTNH", x, self.q[...].astype(dtype))
        k = jnp.einsum("BSD,DKH->BSKH", x, self.k[...].astype(dtype))
        v = jnp.einsum("BSD,DKH->BSKH", x, self.v[...].astype(dtype))
        q = constrain(q, ("batch", "length", "heads", None), self.rules)
        k = constrain(k, ("batch", "length", "kv_heads", None), self.rules)
        v = constrain(v, ("batch", "length", "kv_heads", None), self.rules)
        q = rotary_embedding(q, positions, self.rope_theta)
        k = rotary_embedding(k, positions, self.rope_theta)

        batch, length = x.shape[:2]
        groups = self.num_heads // self.num_kv_heads
        # Query head n = k * G + g, so splitting N into (K, G) keeps the tp sharding on K.
        q = q.reshape(batch, length, self.num_kv_heads, groups, self.head_dim)  # [B, T, K, G, H]
        scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k).astype(jnp.float32)
        scores = scores / jnp.sqrt(jnp.float32(self.head_dim))
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))  # [T, S]
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
        out = out.reshape(batch, length, self.num_heads, self.head_dim)  # [B, T, N, H]
        out = constrain(out, ("batch", "length", "heads", None), self.rules)
        return jnp.einsum("BTNH,NHD->BTD", out, self.o[...].astype(dtype))


class GatedMLP(nnx.Module):
    """Gated MLP: down(act(x·gate) * (x·up)); act=silu is SwiGLU, act=gelu is GeGLU
    (https://arxiv.org/abs/2002.05202)."""

    def __init__(
        self,
        *,
        d_model: int,
        mlp_dim: int,
        activation: str,
        init_std: float,
        rules: Rules,
        rngs: nnx.Rngs,
    ):
        self.activation = activation
        self.rules = rules
        self.gate = normal_param(rngs, (d_model, mlp_dim), ("embed", "mlp"), init_std)
        self.up = normal_param(rngs, (d_model, mlp_dim), ("embed", "mlp"), init_std)
        self.down = normal_param(rngs, (mlp_dim, d_model), ("mlp", "embed"), init_std)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, T, D] → [B, T, D]."""
        dtype = x.dtype
        gate = jnp.einsum("BTD,DF->BTF", x, self.gate[...].astype(dtype))
        up = jnp.einsum("BTD,DF->BTF", x, self.up[...].astype(dtype))
        act = (
            jax.nn.silu if self.activation == "silu" else lambda g: jax.nn.gelu(g, approximate=True)
        )
        hidden = constrain(act(gate) * up, ("batch", "length", "mlp"), self.rules)
        return jnp.einsum("BTF,FD->BTD", hidden, self.down[...].astype(dtype))
