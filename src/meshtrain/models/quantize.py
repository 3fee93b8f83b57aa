"""Block-quantised storage of frozen weights (QLoRA's base): int8 and NF4 codes with one absmax
per block, dequantised on read (`q[...]`).

A weight of shape [*pre, n, *post] is quantised along `axis` (the one of size n, an input axis)
in blocks of `block` consecutive elements: each block keeps its largest |w| (absmax) in fp32
and every element a code for w / absmax, a number in [-1, 1]:
- int8: round(127 · w / absmax), one signed byte per element (absmax quantisation as in
  LLM.int8(), https://arxiv.org/abs/2208.07339, per block instead of per row);
- nf4: the index of the nearest of the 16 NormalFloat levels of QLoRA
  (https://arxiv.org/abs/2305.14314), two codes per byte (bitsandbytes' order: element 2i of
  the axis in the high nibble, 2i+1 in the low one; a pair never straddles two blocks since the
  block is even).

Only jnp ops on whole arrays: quantising and dequantising run under jax.jit on sharded weights,
and give the same bits whatever the sharding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

QuantFormat = Literal["int8", "nf4"]
FORMATS: tuple[str, ...] = ("int8", "nf4")

# NF4: the quantiles of N(0, 1) scaled to [-1, 1], with an exact 0 (QLoRA, appendix E); the
# table bitsandbytes uses (bitsandbytes/functional.py, get_4bit_type("nf4")).
NF4_LEVELS = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
     -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
     0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
     0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0],
    dtype=np.float32,
)  # fmt: skip
# A value goes to level i when it lies in (midpoint i-1, midpoint i]: the nearest level (the
# lower one on an exact tie).
NF4_MIDPOINTS = (NF4_LEVELS[:-1] + NF4_LEVELS[1:]) / np.float32(2)
INT8_MAX = 127


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "absmax"],
    meta_fields=["format", "block", "axis", "dtype", "shape"],
)
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A weight stored as block-quantised codes; reading it (`q[...]`) dequantises it.

    A pytree: the codes and absmax are its leaves, the rest static. Dequantising reads the
    leaves' own shapes and counts `axis` from the end, so leading dimensions may be added or
    removed: layers stacked by jax.vmap over `quantize` (leaves [L, ...], `shape` one layer's),
    or a stacked weight quantised along axis >= 1 and sliced by a scan (leaves one layer's,
    `shape` [L, ...]) both read right, as long as the blocked axis itself is kept whole.
    """

    codes: jax.Array
    """int8 [*shape]; for nf4 uint8 [*shape] with `axis` halved (two codes per byte)."""
    absmax: jax.Array
    """float32 [*shape] with `axis` divided by `block`: each block's largest |w|."""
    format: str
    """'int8' or 'nf4'."""
    block: int
    """Elements per block along `axis`."""
    axis: int
    """The weight's axis the blocks run along (>= 0), an input (contracted) axis."""
    dtype: Any
    """The dtype dequantisation returns (a numpy dtype: hashable)."""
    shape: tuple[int, ...]
    """The weight's shape."""

    def __getitem__(self, index: Any) -> jax.Array:
        if index is not Ellipsis:
            raise IndexError(f"a Quantized weight is read whole (q[...]), not q[{index!r}]")
        return dequantize(self)

    def astype(self, dtype: Any) -> Quantized:
        """The same codes, dequantising to `dtype`."""
        return dataclasses.replace(self, dtype=jnp.dtype(dtype))

    @property
    def ndim(self) -> int:
        return len(self.shape)


def quantized_shapes(
    shape: Sequence[int], format: QuantFormat, block: int, axis: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(codes shape, absmax shape) of a weight of `shape`, without computing anything."""
    error = block_error(shape, format, block, axis)
    if error is not None:
        raise ValueError(error)
    axis = axis % len(shape)
    n = shape[axis]
    codes_n = n // 2 if format == "nf4" else n
    codes = (*shape[:axis], codes_n, *shape[axis + 1 :])
    absmax = (*shape[:axis], n // block, *shape[axis + 1 :])
    return tuple(codes), tuple(absmax)


def storage_bytes(shape: Sequence[int], format: QuantFormat, block: int, axis: int) -> int:
    """Bytes of the codes (one byte per code, or per pair of nf4 codes) plus the fp32 absmax."""
    codes, absmax = quantized_shapes(shape, format, block, axis)
    return math.prod(codes) + 4 * math.prod(absmax)


def block_error(
    shape: Sequence[int],
    format: str,
    block: int,
    axis: int,
    *,
    key: str = "model.lora.quant_block",
) -> str | None:
    """None when `block` can quantise a weight of `shape` along `axis` in `format` (block >= 2,
    divides shape[axis], even for nf4), else a one-line reason that proposes the nearest blocks
    that work. `key` names the setting in the message."""
    if format not in FORMATS:
        return f"unknown quantisation format {format!r}; use one of {', '.join(FORMATS)}"
    if not -len(shape) <= axis < len(shape):
        return f"axis {axis} is out of range for a weight of shape {tuple(shape)}"
    n = shape[axis % len(shape)]
    where = f"the input size {n} (axis {axis % len(shape)} of a weight of shape {tuple(shape)})"
    if block < 2:
        problem = f"{key}={block} must be at least 2"
    elif format == "nf4" and block % 2:
        problem = f"{key}={block} is odd, and nf4 packs two 4-bit codes per byte within a block"
    elif n % block:
        problem = f"{key}={block} does not divide {where}"
    else:
        return None
    fits = [b for b in range(2, n + 1) if n % b == 0 and (format != "nf4" or b % 2 == 0)]
    if not fits:
        even = ", even" if format == "nf4" else ""
        return f"{problem}; no block fits: it must be at least 2{even} and divide {n}"
    below = [b for b in fits if b < block][-1:]
    above = [b for b in fits if b > block][:1]
    nearest = sorted(below + above, key=lambda b: (abs(b - block), b))
    return f"{problem}; use {' or '.join(map(str, nearest))}"


def _blocked(x: jax.Array, axis: int, block: int) -> jax.Array:
    """[*pre, n, *post] -> [*pre, n/block, block, *post]."""
    return x.reshape(*x.shape[:axis], x.shape[axis] // block, block, *x.shape[axis + 1 :])


def pack_nibbles(codes: jax.Array, axis: int) -> jax.Array:
    """uint8 codes < 16 [*pre, n, *post] -> uint8 [*pre, n/2, *post]: element 2i in the high
    nibble, 2i+1 in the low one."""
    pairs = _blocked(codes, axis, 2)  # [*pre, n/2, 2, *post]
    high = jax.lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
    low = jax.lax.index_in_dim(pairs, 1, axis + 1, keepdims=False)
    return (high << 4) | low


def unpack_nibbles(packed: jax.Array, axis: int) -> jax.Array:
    """The inverse of pack_nibbles: uint8 [*pre, n/2, *post] -> uint8 [*pre, n, *post]."""
    pairs = jnp.stack([packed >> 4, packed & 0xF], axis=axis + 1)  # [*pre, n/2, 2, *post]
    shape = packed.shape
    return pairs.reshape(*shape[:axis], 2 * shape[axis], *shape[axis + 1 :])


@functools.partial(jax.jit, static_argnames=("format", "block", "axis", "dtype"))
def quantize(
    w: jax.Array, format: QuantFormat, block: int, axis: int, dtype: Any = None
) -> Quantized:
    """Block-quantise `w` along `axis`; dequantising gives back `dtype` (default: w's)."""
    error = block_error(w.shape, format, block, axis)
    if error is not None:
        raise ValueError(error)
    axis = axis % w.ndim
    blocks = _blocked(w.astype(jnp.float32), axis, block)  # [*pre, n/block, block, *post]
    absmax = jnp.max(jnp.abs(blocks), axis=axis + 1)  # [*pre, n/block, *post]
    # An all-zero block divides by 1: its codes are those of 0, and 0 · absmax is 0 again.
    safe = jnp.where(absmax > 0, absmax, 1.0)
    scaled = (blocks / jnp.expand_dims(safe, axis + 1)).reshape(w.shape)  # in [-1, 1]
    if format == "int8":
        codes = jnp.clip(jnp.round(scaled * INT8_MAX), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    else:
        # The nearest level's index is the count of midpoints below the value (a tie goes to
        # the lower level): 15 elementwise compares that XLA fuses into one pass, with no
        # [*shape, 16] distance tensor and no gather (searchsorted's was constant-folded over
        # whole weights, seconds per compile).
        index = sum((scaled > float(mid)).astype(jnp.uint8) for mid in NF4_MIDPOINTS)
        codes = pack_nibbles(index, axis)
    return Quantized(
        codes=codes,
        absmax=absmax,
        format=format,
        block=block,
        axis=axis,
        dtype=jnp.dtype(w.dtype if dtype is None else dtype),
        shape=tuple(w.shape),
    )


@jax.jit
def dequantize(q: Quantized) -> jax.Array:
    """The weight, [*leading, *shape] (the leaves' leading dimensions: see Quantized), in
    q.dtype: code value × absmax of its block, computed in fp32, then cast."""
    axis = q.axis + q.absmax.ndim - len(q.shape)  # leading dimensions added (+) or sliced (-)
    absmax = jnp.expand_dims(q.absmax, axis + 1)  # [*pre, n/block, 1, *post]
    if q.format == "int8":
        values = q.codes.astype(jnp.float32)
        scale = absmax / INT8_MAX
    elif q.format == "nf4":
        values = jnp.take(
            jnp.asarray(NF4_LEVELS), unpack_nibbles(q.codes, axis).astype(jnp.int32), mode="clip"
        )
        scale = absmax
    else:
        raise ValueError(f"unknown quantisation format {q.format!r}; use one of {FORMATS}")
    w = _blocked(values, axis, q.block) * scale  # [*pre, n/block, block, *post]
    return w.reshape(values.shape).astype(q.dtype)
