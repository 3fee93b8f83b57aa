"""LoRA adapters (https://arxiv.org/abs/2106.09685) beside the projections of a block.

A target projection y = x·W, W [*in, *out], gains two parameters, A [*in, r] and B [r, *out], and
computes y = x·W + alpha/r · (x·A)·B. A starts uniform in ±1/sqrt(in) (PEFT's Kaiming-uniform),
B at zero, so a fresh adapter leaves the model's output unchanged. A is sharded like W's input
axes and B like its output axes (the rank axis `lora_rank` is replicated), on every mesh.

Adapters are attributes `<projection>_lora_a` / `_lora_b` of the Attention and GatedMLP modules,
so in a parameter tree they sit next to their weight: blocks/3/attn/q_lora_a. A draws from its
own key stream (DrawKeys.lora), so adding adapters changes no base parameter's random value.

Dropout (model.lora.dropout, in training only) zeroes entries of an adapter's input x, as PEFT's
lora_dropout does, the kept ones scaled by 1/(1 - p). The mask of a sequence depends only on
its own key (`AdapterDropout.row_keys`: the step's key folded with the sequence's index in the
global batch), the layer and the projection, never on how the batch is split over devices,
micro-batches or gradient groups: every mesh draws the same masks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.config.lora import lora_enabled, target_projections
from meshtrain.config.schema import ModelConfig
from meshtrain.families.vocabulary import PROJECTION_NAMES
from meshtrain.hardware.target import target_device
from meshtrain.parallel.context import CONTEXT_AXIS

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")
PROJECTION_INDEX = {name: i for i, name in enumerate(PROJECTION_NAMES)}  # salts the dropout keys


@dataclass(frozen=True)
class LoraSpec:
    """What a block needs of model.lora (hashable: it is static module data)."""

    rank: int
    scale: float  # alpha / rank
    targets: tuple[str, ...]  # projection names (families.vocabulary)
    dropout: float = 0.0  # on the adapters' input, in training

    @classmethod
    def of(cls, cfg: ModelConfig) -> LoraSpec | None:
        """The spec of `cfg`'s adapters; None without LoRA."""
        if not lora_enabled(cfg):
            return None
        lora = cfg.lora
        targets = target_projections(cfg)
        return cls(lora.rank, lora.alpha / lora.rank, targets, lora.dropout)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AdapterDropout:
    """The randomness of adapter dropout in one pass: a key per sequence of the batch
    (uint32 [B, 2], jax.random.key_data) and the layer (int32 [], or an int) being run."""

    row_keys: jax.Array
    layer: Any = 0

    def at_layer(self, layer: Any) -> AdapterDropout:
        return AdapterDropout(self.row_keys, layer)

    def apply(self, x: jax.Array, projection: str, rate: float) -> jax.Array:
        """x [B, T, *in] with entries zeroed with probability `rate`, the rest / (1 - rate)."""
        salt = PROJECTION_INDEX[projection]

        def one(key: jax.Array, row: jax.Array) -> jax.Array:
            key = jax.random.fold_in(jax.random.wrap_key_data(key), self.layer)
            keep = jax.random.bernoulli(jax.random.fold_in(key, salt), 1.0 - rate, row.shape)
            return jnp.where(keep, row / jnp.asarray(1.0 - rate, row.dtype), 0).astype(row.dtype)

        return jax.vmap(one)(self.row_keys, x)


def row_keys(step_key: jax.Array, rows: jax.Array) -> jax.Array:
    """uint32 [*rows.shape, 2]: the dropout key of each sequence, from the step's key and the
    sequences' indices in the global batch (int32 rows)."""
    one = lambda row: jax.random.key_data(jax.random.fold_in(step_key, row))  # noqa: E731
    flat = jax.vmap(one)(rows.reshape(-1))
    return flat.reshape(*rows.shape, flat.shape[-1])


def add_adapter(
    module: nnx.Module,
    name: str,
    rngs: Any,
    spec: LoraSpec | None,
    *,
    inputs: int = 1,
    leading: int = 0,
) -> None:
    """Gives `module` the adapter of its projection weight `name` when `spec` targets it. The
    weight is [*lead, *in, *out]: its first `leading` axes index independent matrices (a
    mixture's experts E) and the next `inputs` axes are contracted. The adapter is
    `<name>_lora_a` [*lead, *in, r] with the weight's leading and input axes and
    `<name>_lora_b` [*lead, r, *out] with its leading and output axes: one A and B per matrix.
    A is uniform in ±1/sqrt(in) (in: the product of the input axes), B zero."""
    if spec is None or name not in spec.targets:
        return
    weight = getattr(module, name)
    axes = weight.get_metadata()["logical_axes"]
    split = leading + inputs
    lead_shape, in_shape = weight.shape[:leading], weight.shape[leading:split]
    out_shape = weight.shape[split:]
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    a = jax.random.uniform(
        rngs.lora(), (*lead_shape, *in_shape, spec.rank), jnp.float32, minval=-bound, maxval=bound
    )
    b = jnp.zeros((*lead_shape, spec.rank, *out_shape), jnp.float32)
    a_axes = (*axes[:split], "lora_rank")
    b_axes = (*axes[:leading], "lora_rank", *axes[split:])
    setattr(module, f"{name}_lora_a", nnx.LoRAParam(a, logical_axes=a_axes))
    setattr(module, f"{name}_lora_b", nnx.LoRAParam(b, logical_axes=b_axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def adapter_output(
    equation: str, x: jax.Array, a: jax.Array, b: jax.Array, scale: float
) -> jax.Array:
    """alpha/r · (x·A)·B for the projection `equation` (e.g. "BTD,DNH->BTNH", see
    models.layers.project): x [B, T, *in], a [*in, r], b [r, *out] → [B, T, *out].

    The backward pass spells out the adapters' gradients as 2-D matmuls with the small rank-r
    operand transposed, materialised first on CPU (as models.layers.project does for a weight
    gradient): dB = (s·x·A)^T [r, B·T] @ dy [B·T, out] and dA = x^T [in, B·T] @ (s·dy·B^T)
    [B·T, r]. Left to itself, XLA's CPU backend transposes the large dy instead (each layer's
    MLP gradient, 2048 × 1536 at the fine-tuning benchmark's shape). The gradients are the
    einsums' own, to the rounding of the matmul."""
    return _adapter_fwd(equation, x, a, b, scale)[0]


def _adapter_fwd(equation: str, x: jax.Array, a: jax.Array, b: jax.Array, scale: float):
    inputs, out = equation.split("->")
    x_spec, _ = inputs.split(",")
    lead, contracted = x_spec[:2], x_spec[2:]
    down = jnp.einsum(f"{x_spec},{contracted}r->{lead}r", x, a) * jnp.asarray(scale, x.dtype)
    return jnp.einsum(f"{lead}r,r{out[2:]}->{out}", down, b), (x, a, b, down)  # down: [B, T, r]


def _adapter_bwd(equation: str, scale: float, residuals, dy: jax.Array):
    x, a, b, down = residuals
    rank, lead = down.shape[-1], x.shape[:2]
    a_2d, b_2d = a.reshape(-1, rank), b.reshape(rank, -1)  # [in, r], [r, out]
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.shape.get(CONTEXT_AXIS, 1) > 1:
        # x split along T over cp as well as along B (see models.layers.project): merging the
        # two would gather T, so einsums over [B, T, ...].
        x_3d, dy_3d = x.reshape(*lead, -1), dy.reshape(*lead, -1)
        d_down = jnp.einsum("bto,ro->btr", dy_3d, b_2d) * jnp.asarray(scale, dy.dtype)
        da = jnp.einsum("btk,btr->kr", x_3d, d_down)
        db = jnp.einsum("btr,bto->ro", down, dy_3d)
    else:
        tokens = math.prod(lead)
        dy_2d = dy.reshape(tokens, -1)  # [B·T, out]
        d_down = (dy_2d @ b_2d.T) * jnp.asarray(scale, dy.dtype)  # [B·T, r]
        down_t, x_t = down.reshape(tokens, rank).T, x.reshape(tokens, -1).T  # [r | in, B·T]
        if target_device().platform == "cpu":
            down_t, x_t = jax.lax.optimization_barrier((down_t, x_t))
        db, da = down_t @ dy_2d, x_t @ d_down
        d_down = d_down.reshape(*lead, rank)
    dx = jnp.einsum("btr,kr->btk", d_down, a_2d).reshape(x.shape)
    return dx, da.reshape(a.shape).astype(a.dtype), db.reshape(b.shape).astype(b.dtype)


adapter_output.defvjp(_adapter_fwd, _adapter_bwd)


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """W + alpha/r · A·B, fp32, in W's layout [*lead, *in, *out]: a [*lead, *in, r], b
    [*lead, r, *out]. The leading axes (a stacked layers axis L, a mixture's experts E, or both:
    [L, E, ...]) are on all three and batch the product, so each matrix W_l,e gets its own
    A_l,e·B_l,e; their number is a.ndim + b.ndim - 2 - w.ndim."""
    leading = a.ndim + b.ndim - 2 - w.ndim
    if not 0 <= leading <= min(a.ndim, b.ndim) - 2:
        raise ValueError(
            f"an adapter a {a.shape}, b {b.shape} does not fit a weight of shape {w.shape}"
        )
    lead = "ABCD"[:leading]
    in_letters = "ijkl"[: a.ndim - 1 - leading]
    out_letters = "mnop"[: b.ndim - 1 - leading]
    delta = jnp.einsum(
        f"{lead}{in_letters}r,{lead}r{out_letters}->{lead}{in_letters}{out_letters}",
        a.astype(jnp.float32),
        b.astype(jnp.float32),
    )
    return w.astype(jnp.float32) + scale * delta


def is_adapter_key(key: Any) -> bool:
    return isinstance(key, str) and key.endswith(ADAPTER_SUFFIXES)


def split_adapters(tree: Mapping) -> tuple[dict, dict]:
    """(adapters, the rest) of a nested dict of parameters (arrays, shapes or shardings): two
    nested dicts of the same nesting, each with only its own leaves (and no empty dicts)."""
    adapters, rest = {}, {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            inner_adapters, inner_rest = split_adapters(value)
            if inner_adapters:
                adapters[key] = inner_adapters
            if inner_rest:
                rest[key] = inner_rest
        elif is_adapter_key(key):
            adapters[key] = value
        else:
            rest[key] = value
    return adapters, rest


def join_adapters(adapters: Mapping, rest: Mapping) -> dict:
    """The nested dict split_adapters split: both trees' leaves in one."""
    joined = dict(rest)
    for key, value in adapters.items():
        if isinstance(value, Mapping):
            joined[key] = join_adapters(value, rest.get(key, {}))
        else:
            joined[key] = value
    return joined


def adapter_pairs(params: Mapping, path: tuple = ()) -> list[tuple[tuple, str]]:
    """(path of the module, projection name) of every adapter in a nested dict, in order."""
    pairs = []
    for key, value in params.items():
        if isinstance(value, Mapping):
            pairs += adapter_pairs(value, (*path, key))
        elif isinstance(key, str) and key.endswith("_lora_a"):
            pairs.append((path, key.removesuffix("_lora_a")))
    return pairs


def merge_adapters(params: Mapping, scale: float) -> dict:
    """The parameters with every adapter folded into its weight (W + alpha/r · A·B, fp32) and
    the adapters removed: a plain model's parameters, for export."""
    adapters, base = split_adapters(params)
    merged = jax.tree.map(lambda leaf: leaf, base)
    for path, name in adapter_pairs(adapters):
        module_adapters, module = adapters, merged
        for key in path:
            module_adapters, module = module_adapters[key], module[key]
        a, b = module_adapters[f"{name}_lora_a"], module_adapters[f"{name}_lora_b"]
        module[name] = merged_weight(module[name], a, b, scale)
    return merged
