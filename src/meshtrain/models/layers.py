"""Transformer building blocks in Flax NNX; every parameter carries its logical axis names.

Dimension letters in einsum strings: B batch, T query length, S key length, D model (embed),
N query heads, K key/value heads, G query heads per key/value head, H head_dim, F mlp hidden, V vocab.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.config.schema import RopeScaling
from meshtrain.families.vocabulary import ATTENTION, GATED_MLP
from meshtrain.hardware.target import target_device
from meshtrain.models.attention import AttentionKernel, WindowOfKind, dot_product_attention
from meshtrain.models.context_attention import context_parallel_attention
from meshtrain.models.lora import AdapterDropout, LoraSpec, adapter_output, add_adapter
from meshtrain.parallel.context import CONTEXT_AXIS, context_layout, sequence_axes
from meshtrain.parallel.rules import Rules, active_axes, constrain, mesh_axes_for, rules_without


def normal_param(
    rngs: nnx.Rngs, shape: Sequence[int], logical_axes: Sequence[str], std: float
) -> nnx.Param:
    return nnx.Param(
        std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32),
        logical_axes=tuple(logical_axes),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def project(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """A projection: jnp.einsum(equation, x, w) where x is [B, T, *in] and w [*in, *out] (the
    dimensions `in` are contracted), e.g. "BTD,DNH->BTNH".

    The forward pass is that einsum. The backward pass spells out the weight gradient as one
    2-D matmul, x^T [in, B·T] @ dy [B·T, out], with x^T materialised first on CPU: left to
    itself, XLA's CPU backend folds the transpose into the dot and transposes the larger dy
    instead, into a dot its fast matmul library does not take (the MLP's backward pass ran
    1.7× slower so). The gradients are the einsum's own, to the rounding of the matmul.
    """
    return jnp.einsum(equation, x, w)


def _project_fwd(equation: str, x: jax.Array, w: jax.Array):
    return jnp.einsum(equation, x, w), (x, w)


def _project_bwd(equation: str, residuals, dy: jax.Array):
    x, w = residuals
    inputs, out = equation.split("->")
    x_spec, w_spec = inputs.split(",")
    dx = jnp.einsum(f"{out},{w_spec}->{x_spec}", dy, w)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.shape.get(CONTEXT_AXIS, 1) > 1:
        # x split along T over cp as well as along B: merging the two in one matrix would
        # gather T; the einsum sums each device's positions, then reduces over the devices.
        return dx, jnp.einsum(f"{x_spec},{out}->{w_spec}", x, dy).astype(w.dtype)
    contracted = x.ndim - 2  # x: [B, T, *in]
    x_t = x.reshape(-1, math.prod(x.shape[2:])).T  # [in, B·T]
    if target_device().platform == "cpu":
        x_t = jax.lax.optimization_barrier(x_t)
    dw = x_t @ dy.reshape(-1, math.prod(w.shape[contracted:]))
    return dx, dw.reshape(w.shape).astype(w.dtype)


project.defvjp(_project_fwd, _project_bwd)


class Projections(nnx.Module):
    """A module of projections, each of which may carry a LoRA adapter (models.lora)."""

    lora: LoraSpec | None = None

    def projected(
        self, name: str, equation: str, x: jax.Array, dropout: AdapterDropout | None = None
    ) -> jax.Array:
        """x projected by the weight `name` (see `project`), plus its adapter's output if it has
        one (its input dropped out with `dropout`, in training); in x's dtype (the caller casts
        the parameters)."""
        y = project(equation, x, self.gathered(name, self.weight(name).astype(x.dtype)))
        if self.lora is None or name not in self.lora.targets:
            return y
        a = self.gathered(f"{name}_lora_a", getattr(self, f"{name}_lora_a")[...].astype(x.dtype))
        b = self.gathered(f"{name}_lora_b", getattr(self, f"{name}_lora_b")[...].astype(x.dtype))
        if dropout is not None and self.lora.dropout > 0:
            x = dropout.apply(x, name, self.lora.dropout)
        return y + adapter_output(equation, x, a, b, self.lora.scale)

    def gathered(self, name: str, w: jax.Array) -> jax.Array:
        """The parameter `name`'s value w gathered over the axes that split sequences (cp),
        which shard the weights as fsdp does: where x is split along T over cp, XLA would
        otherwise gather x's positions rather than the weight. Unchanged without cp."""
        mesh = jax.sharding.get_abstract_mesh()
        axes = () if mesh.empty else sequence_axes(mesh.shape, self.rules)
        if not axes:
            return w
        logical = getattr(self, name).get_metadata()["logical_axes"][-w.ndim :]  # a layer's
        return constrain(w, logical, rules_without(self.rules, axes))

    def weight(self, name: str) -> jax.Array:
        """The weight `name` as stored, read (a quantised one dequantises here, per layer)."""
        return getattr(self, name)[...]


class RMSNorm(nnx.Module):
    """Root-mean-square norm (https://arxiv.org/abs/1910.07467), computed in fp32.

    The output is multiplied by (scale_offset + scale). Gemma stores its scales as "scale - 1"
    (initialised to 0) and uses scale_offset=1; everyone else stores the scale itself.
    """

    def __init__(self, dim: int, *, eps: float, scale_offset: float = 0.0):
        self.scale = nnx.Param(
            jnp.full((dim,), 1.0 - scale_offset, jnp.float32), logical_axes=("norm",)
        )
        self.eps = eps
        self.scale_offset = scale_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        if self.scale_offset:
            scale = scale + self.scale_offset
        return (normed * scale).astype(x.dtype)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding frequencies of one kind of layer (hashable: it is static module data)."""

    theta: float
    scaling: RopeScaling = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def inv_freq(self, head_dim: int) -> jax.Array:
        """Angular frequency of each rotated pair, fp32 [H/2].

        linear: every frequency divided by the factor (positions interpolated), as Gemma 3's
        global layers. llama3: Llama 3.1's rule (the `_compute_llama3_parameters` of Hugging Face
        transformers): wavelengths longer than original_max_len / low_freq_factor are divided by
        the factor, shorter than original_max_len / high_freq_factor kept, and those in between
        interpolated smoothly.
        """
        half = head_dim // 2
        inv_freq = self.theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
        if self.scaling == "linear":
            return inv_freq / self.factor
        if self.scaling == "llama3":
            wavelen = 2 * jnp.pi / inv_freq
            low_freq_wavelen = self.original_max_len / self.low_freq_factor
            high_freq_wavelen = self.original_max_len / self.high_freq_factor
            scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (self.original_max_len / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            return jnp.where(medium, smoothed, scaled)
        return inv_freq


def rope_angles(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """sin and cos of position × frequency, fp32 [B, T, 1, H/2] each. positions: [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    return jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotary position embedding (https://arxiv.org/abs/2104.09864), "rotate half" layout as in
    Llama and Hugging Face: dimension i pairs with i + head_dim/2.

    x: [B, T, heads, H]; sin, cos: [B, T, 1, H/2].
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class Attention(Projections):
    """Grouped-query causal self-attention: K key/value heads, each shared by G = N/K query heads."""

    def __init__(
        self,
        *,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        query_pre_attn_scalar: float | None,
        qk_norm: bool,
        norm_eps: float,
        norm_scale_offset: float,
        init_std: float,
        rules: Rules,
        rngs: nnx.Rngs,
        lora: LoraSpec | None = None,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # Scores are divided by sqrt(head_dim) unless the model says otherwise (Gemma 3 27B: 168).
        self.score_scale_dim = query_pre_attn_scalar or head_dim
        self.rules = rules
        shapes = {
            "q": (d_model, num_heads, head_dim),
            "k": (d_model, num_kv_heads, head_dim),
            "v": (d_model, num_kv_heads, head_dim),
            "o": (num_heads, head_dim, d_model),
        }
        self.lora = lora
        for projection in ATTENTION:
            name = projection.name
            setattr(self, name, normal_param(rngs, shapes[name], projection.axes, init_std))
            add_adapter(self, name, rngs, lora, inputs=projection.inputs)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps, scale_offset=norm_scale_offset)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps, scale_offset=norm_scale_offset)
        else:
            self.q_norm = self.k_norm = None

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
    ) -> jax.Array:
        """x: [B, T, D] → [B, T, D]; sin, cos: [B, T, 1, H/2] (rope_angles); window: this
        layer's sliding window (None: full causal), or those of a traced kind (WindowOfKind);
        segment_ids: optional int32 [B, T]; dropout: of the adapters' inputs, in training.
        Under a mesh that splits the sequence over cp, x and the rest are in the context
        layout (meshtrain.parallel.context)."""
        q, k, v = self.queries_keys_values(x, sin, cos, dropout)
        k, v = self.expand_kv(k, v)
        # Query head n reads key/value head n // G (G = N / K), so the tp sharding of the heads
        # keeps each group on the device of its key/value head. Split over cp, the sequence is
        # in the context layout (Transformer.hidden), and the keys and values are gathered.
        layout = context_layout(q.shape[1], self.rules)
        attend = (
            dot_product_attention
            if layout is None
            else functools.partial(
                context_parallel_attention,
                layout=layout,
                batch_axes=self.batch_axes(q.shape[0]),
                manual_axes=self.row_axes(),
            )
        )
        out = attend(
            q, k, v, kernel=kernel, scale=self.scale, window=window, segment_ids=segment_ids
        )  # [B, T, N, H]
        return self.output(out, dropout)

    def batch_axes(self, batch: int) -> tuple[str, ...]:
        """The mesh axes of size > 1 a batch of `batch` rows is split over in the current mesh
        (none where they do not divide it)."""
        mesh = jax.sharding.get_abstract_mesh()
        axes = active_axes(mesh_axes_for("batch", self.rules), mesh.shape)
        return axes if batch % math.prod(mesh.shape[a] for a in axes) == 0 else ()

    def row_axes(self) -> tuple[str, ...]:
        """The mesh axes of size > 1 that do not split the heads (nor are manual already)."""
        mesh = jax.sharding.get_abstract_mesh()
        heads = {*mesh_axes_for("heads", self.rules), *mesh_axes_for("kv_heads", self.rules)}
        return tuple(
            a
            for a in mesh.axis_names
            if mesh.shape[a] > 1 and a not in heads and a not in mesh.manual_axes
        )

    @property
    def scale(self) -> float:
        """The factor of the attention scores."""
        return 1.0 / math.sqrt(self.score_scale_dim)

    def queries_keys_values(
        self, x: jax.Array, sin: jax.Array, cos: jax.Array, dropout: AdapterDropout | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [B, T, D] → queries [B, T, N, H], keys and values [B, T, K, H]: projected,
        QK-normed and rotated (the keys and values are what a key/value cache holds)."""
        q = self.projected("q", "BTD,DNH->BTNH", x, dropout)
        k = self.projected("k", "BSD,DKH->BSKH", x, dropout)
        v = self.projected("v", "BSD,DKH->BSKH", x, dropout)
        q = constrain(q, ("batch", "length", "heads", None), self.rules)
        k = constrain(k, ("batch", "length", "kv_heads", None), self.rules)
        v = constrain(v, ("batch", "length", "kv_heads", None), self.rules)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, sin, cos), apply_rope(k, sin, cos), v

    def expand_kv(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, S, K, H] as the attention kernel reads them: unchanged, or
        [B, S, N, H] when the key/value heads are replicated while the query heads are split
        (more tp ranks than key/value heads, models.abstract.fit_kv_heads): each repeated for
        its G query heads, so that each rank holds exactly the ones its query heads read."""
        if mesh_axes_for("kv_heads", self.rules) == mesh_axes_for("heads", self.rules):
            return k, v
        groups = self.num_heads // self.num_kv_heads
        k = constrain(jnp.repeat(k, groups, axis=2), ("batch", "length", "heads", None), self.rules)
        v = constrain(jnp.repeat(v, groups, axis=2), ("batch", "length", "heads", None), self.rules)
        return k, v

    def output(self, out: jax.Array, dropout: AdapterDropout | None = None) -> jax.Array:
        """The attention's output [B, T, N, H] projected back to [B, T, D]."""
        out = constrain(out, ("batch", "length", "heads", None), self.rules)
        return self.projected("o", "BTNH,NHD->BTD", out, dropout)


class GatedMLP(Projections):
    """Gated MLP: down(act(x·gate) * (x·up)); act=silu is SwiGLU, act=gelu (tanh approximation,
    Hugging Face's gelu_pytorch_tanh) is GeGLU (https://arxiv.org/abs/2002.05202)."""

    def __init__(
        self,
        *,
        d_model: int,
        mlp_dim: int,
        activation: str,
        init_std: float,
        rules: Rules,
        rngs: nnx.Rngs,
        lora: LoraSpec | None = None,
    ):
        self.activation = activation
        self.rules = rules
        shapes = {"gate": (d_model, mlp_dim), "up": (d_model, mlp_dim), "down": (mlp_dim, d_model)}
        self.lora = lora
        for projection in GATED_MLP:
            name = projection.name
            setattr(self, name, normal_param(rngs, shapes[name], projection.axes, init_std))
            add_adapter(self, name, rngs, lora, inputs=projection.inputs)

    def __call__(self, x: jax.Array, dropout: AdapterDropout | None = None) -> jax.Array:
        """x: [B, T, D] → [B, T, D]."""
        gate = self.projected("gate", "BTD,DF->BTF", x, dropout)
        up = self.projected("up", "BTD,DF->BTF", x, dropout)
        act = (
            jax.nn.silu if self.activation == "silu" else lambda g: jax.nn.gelu(g, approximate=True)
        )
        hidden = constrain(act(gate) * up, ("batch", "length", "mlp"), self.rules)
        return self.projected("down", "BTF,FD->BTD", hidden, dropout)
