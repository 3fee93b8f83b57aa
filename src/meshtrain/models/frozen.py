"""The frozen base of a LoRA run (model.lora): every parameter but the adapters, stored at
model.lora.base_dtype and never trained, so it has no gradient, no optimizer state and no place
in the checkpoints (they name it: weights.lora_base).

- compute, bf16: every base parameter in that dtype (compute: training.mixed_precision's).
- int8, nf4 (QLoRA): the blocks' projections q, k, v, o, gate, up, down as block-quantised codes
  (models.quantize.Quantized: absmax per model.lora.quant_block weights along the projection's
  input axis, the head axis for o), each dequantised to the compute dtype where its layer reads
  it, inside the scan over layers; everything else (embedding, norms, head) in the compute dtype.

Shardings follow the parameters': codes and absmax keep the weight's PartitionSpec, except that
the blocked axis is replicated where its shortened size does not divide over its mesh axes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.config.lora import QUANTIZED, LoraConfig
from meshtrain.config.schema import ModelConfig
from meshtrain.errors import ConfigError
from meshtrain.families import family
from meshtrain.models.quantize import Quantized, block_error, quantize, quantized_shapes


def storage_dtype(lora: LoraConfig, compute_dtype: Any) -> Any:
    """The dtype of the base's unquantised parameters."""
    return jnp.bfloat16 if lora.base_dtype == "bf16" else compute_dtype


def _quantized_axis(path: tuple, leaf: Any, cfg: ModelConfig) -> int | None:
    """The blocked axis of the leaf at `path` when QLoRA quantises it, else None: the axis its
    projection declares (families.vocabulary; the input axis, the head axis H for o) in the
    block's own weight, after a leading layers axis under scan_layers."""
    projection = family(cfg.family).projection.get(path[-1] if path else None)
    if cfg.lora.base_dtype not in QUANTIZED or "blocks" not in path:
        return None
    if projection is None or not projection.lora_target:  # a norm, a router
        return None
    stacked = len(leaf.shape) - len(projection.axes)
    return projection.block_axis + stacked


def _map_with_path(fn, tree: Mapping, path: tuple = ()) -> dict:
    return {
        key: _map_with_path(fn, value, (*path, key))
        if isinstance(value, Mapping)
        else fn((*path, key), value)
        for key, value in tree.items()
    }


def _spec_along(spec: PartitionSpec, ndim: int, axis: int, size: int, mesh: Any) -> PartitionSpec:
    """`spec` (for `ndim` dims) with `axis` replicated unless `size` divides over its mesh axes."""
    entries = list(spec) + [None] * (ndim - len(spec))
    names = entries[axis]
    names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
    if size % math.prod(mesh.shape[n] for n in names):
        entries[axis] = None
    return PartitionSpec(*entries)


def frozen_layout(
    base_abstract: Mapping, base_shardings: Mapping, cfg: ModelConfig, compute_dtype: Any
) -> tuple[dict, dict]:
    """(ShapeDtypeStructs, shardings) of the stored base, from the base parameters' shapes and
    shardings: Quantized nodes where QLoRA quantises."""
    lora = cfg.lora

    def shapes(path: tuple, leaf: Any) -> Any:
        axis = _quantized_axis(path, leaf, cfg)
        if axis is None:
            return jax.ShapeDtypeStruct(leaf.shape, storage_dtype(lora, compute_dtype))
        codes, absmax = quantized_shapes(leaf.shape, lora.base_dtype, lora.quant_block, axis)
        codes_dtype = jnp.int8 if lora.base_dtype == "int8" else jnp.uint8
        return Quantized(
            codes=jax.ShapeDtypeStruct(codes, codes_dtype),
            absmax=jax.ShapeDtypeStruct(absmax, jnp.float32),
            format=lora.base_dtype,
            block=lora.quant_block,
            axis=axis,
            dtype=jnp.dtype(compute_dtype),
            shape=tuple(leaf.shape),
        )

    abstract = _map_with_path(shapes, base_abstract)

    def shardings(path: tuple, sharding: NamedSharding) -> Any:
        node = _leaf_at(abstract, path)
        if not isinstance(node, Quantized):
            return sharding

        def part(array: jax.ShapeDtypeStruct) -> NamedSharding:
            ndim, size = len(array.shape), array.shape[node.axis]
            spec = _spec_along(sharding.spec, ndim, node.axis, size, sharding.mesh)
            return NamedSharding(sharding.mesh, spec)

        return dataclasses.replace(node, codes=part(node.codes), absmax=part(node.absmax))

    return abstract, _map_with_path(shardings, base_shardings)


def _leaf_at(tree: Mapping, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def check_quant_blocks(base_abstract: Mapping, cfg: ModelConfig) -> None:
    """ConfigError naming model.lora.quant_block when it cannot quantise a projection."""
    lora = cfg.lora

    def check(path: tuple, leaf: Any) -> None:
        axis = _quantized_axis(path, leaf, cfg)
        if axis is None:
            return
        reason = block_error(leaf.shape, lora.base_dtype, lora.quant_block, axis)
        if reason is not None:
            where = f"model.lora.base_dtype={lora.base_dtype}, projection {path[-1]}"
            raise ConfigError(f"{where}: {reason}")

    _map_with_path(check, base_abstract)


def store_base(params: dict, abstract: Mapping, shardings: Mapping) -> dict:
    """The base parameters (a nested dict of arrays, any dtype) in their stored form
    (frozen_layout), converted in place one leaf at a time: each array read is released as
    soon as its stored form exists, so the peak is about the base plus one parameter."""
    for key, value in params.items():
        if isinstance(value, dict):
            store_base(value, abstract[key], shardings[key])
            continue
        node = abstract[key]
        if isinstance(node, Quantized):
            how = (node.format, node.block, node.axis, node.dtype)
        elif value.dtype == node.dtype:
            continue
        else:
            how = (node.dtype,)
        params[key] = _storing_program(how, shardings[key])(value)
        del value
    return params


@functools.cache
def _storing_program(how: tuple, sharding: Any) -> Any:
    """One compiled program per way of storing and sharding (the layers share them)."""

    def store(w: jax.Array) -> Any:
        return w.astype(how[0]) if len(how) == 1 else quantize(w, *how)

    return jax.jit(store, out_shardings=sharding)


def is_quantized(leaf: Any) -> bool:
    return isinstance(leaf, Quantized)
