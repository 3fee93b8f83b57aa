"""A grouped matmul that costs the useful FLOPs: jax.lax.ragged_dot's semantics, run block by
block.

Dimension letters: M rows, K contracted, N out, G groups, b rows per block, R blocks (a static
bound on the blocks the groups need).

jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G]) is lowered by XLA (on CPU, and on
GPU by default) to a zero-padded dense product: every row times every group's rhs, G times the
useful FLOPs (128 times for a mixture of 128 experts). grouped_matmul pads each group's rows to a
multiple of b, so that every block of b rows belongs to one group, and multiplies each block by
its own group's [K, N] (a dynamic index into rhs, nothing gathered to [R, K, N]) in a loop that
stops after the blocks the groups use: the useful FLOPs plus at most b - 1 padded rows per
group. Its gradients (a custom VJP) are built the same way: d_lhs is grouped_matmul of d_out by
each group's rhs transposed, d_rhs[g] = lhs_g^T · d_out_g accumulated block by block into
[G, K, N].
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

MIN_BLOCK = 8
"""The smallest block grouped_matmul shrinks to when there are few rows per group."""


def grouped_matmul(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, block: int = 128
) -> jax.Array:
    """jax.lax.ragged_dot(lhs, rhs, group_sizes) at about the useful FLOPs: lhs [M, K], rhs
    [G, K, N], group_sizes [G] (integers, may be traced) → [M, N].

    The rows are sorted by group: row m belongs to group g when
    cumsum(group_sizes)[g - 1] <= m < cumsum(group_sizes)[g]; the rows at or past
    sum(group_sizes) give zeros (a sum past M cuts the last groups short, as ragged_dot does).
    Products accumulate in fp32 and come back in the inputs' promoted dtype (lhs's, when both
    match: bf16 for bf16, as ragged_dot's default); differentiable w.r.t. lhs and rhs.

    block: the most rows b one step multiplies, [b, K] · [K, N]. Each group's rows are padded
    to a multiple of b, so the work is that of M + G·(b - 1) rows at worst, run as up to
    R = ceil(M / b) + min(G, M) - 1 sequential steps. A larger b makes fewer, larger (more
    efficient) matmuls but pads more; a smaller b pads less but pays each step's overhead and
    reads each group's [K, N] once per block. b is shrunk (to a power of two, at least
    MIN_BLOCK) when M / G rows per group would fill less than a block, so that a few rows over
    many groups (decoding through many experts) pad little. On a 2-core CPU at M = 8192, K =
    512, N = 1024 with G = 8 or 64 even groups (fp32, median ms, forward / forward+backward):
    b = 64: 95 / 248 and 98 / 304; b = 128: 93 / 218 and 106 / 272; b = 256: 94 / 223 and
    144 / 415 (each group's 128 rows padded to 256); one dense [M, K] · [K, N]: 76 / 180;
    ragged_dot: 562 / 1625 and 4386 / 13534.

    Reverse mode only (a custom VJP): jax.jvp and jax.jacfwd through it are refused. Under
    jax.vmap the loops run to the longest member's block count.
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(
            f"grouped_matmul wants lhs [M, K], rhs [G, K, N], group_sizes [G]; got {lhs.shape}, "
            f"{rhs.shape}, {group_sizes.shape}"
        )
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"lhs [M, K] {lhs.shape} and rhs [G, K, N] {rhs.shape} differ in K")
    if block < 1:
        raise ValueError(f"block must be positive, got {block}")
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    rows, groups = lhs.shape[0], rhs.shape[0]
    if rows == 0 or groups == 0:
        return jnp.zeros((rows, rhs.shape[2]), dtype)
    return _grouped(
        lhs.astype(dtype),
        rhs.astype(dtype),
        group_sizes.astype(jnp.int32),
        _block(block, rows, groups),
    )


def _block(block: int, rows: int, groups: int) -> int:
    """The rows per block: `block`, or less where M / G rows per group fill less than one."""
    per_group = -(-rows // groups)
    fit = max(MIN_BLOCK, 1 << (per_group - 1).bit_length())  # a power of two >= M / G
    return max(1, min(block, fit, rows))


class _Layout(NamedTuple):
    """Each block's place: block r multiplies rows first[r] ... first[r] + b - 1 (those from
    first[r] + count[r] on belong to later groups, or to none, and are masked) by rhs[group[r]]."""

    used: jax.Array  # int32 []: the blocks the groups use (at most R), blocks 0 ... used - 1
    group: jax.Array  # int32 [R]: each block's group
    first: jax.Array  # int32 [R]: each block's first row
    count: jax.Array  # int32 [R]: each block's rows in its group, 1 ... b


def _layout(group_sizes: jax.Array, rows: int, block: int) -> _Layout:
    groups = group_sizes.shape[0]
    num_blocks = -(-rows // block) + min(groups, rows) - 1  # R >= sum(ceil(size_g / b))
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), rows)  # [G]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # [G]
    block_ends = jnp.cumsum((ends - starts + block - 1) // block)  # [G]
    block_starts = block_ends - (ends - starts + block - 1) // block  # [G]
    index = jnp.arange(num_blocks, dtype=jnp.int32)  # [R]
    group = jnp.minimum(jnp.searchsorted(block_ends, index, side="right"), groups - 1)
    first = starts[group] + (index - block_starts[group]) * block
    return _Layout(block_ends[-1], group, first, jnp.minimum(ends[group] - first, block))


def _rows(x: jax.Array, layout: _Layout, r: jax.Array, block: int) -> jax.Array:
    """Block r's rows of x [M + b, i] (M rows and b of padding) → [b, i], zero past its group."""
    rows = jax.lax.dynamic_slice_in_dim(x, layout.first[r], block)
    keep = jnp.arange(block) < layout.count[r]
    return jnp.where(keep[:, None], rows, jnp.zeros((), x.dtype))


def _forward(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, block: int, transpose: bool):
    """lhs [M, i] times each row's group's rhs [i, o] (rhs [G, i, o]; with transpose, rhs
    [G, o, i], transposed) → [M, o] in lhs's dtype.

    Block r writes its b products at its first row, in order, so that a block's masked tail
    (zeros) lands on rows that the next group's blocks overwrite, or on rows past the groups',
    which stay zero."""
    rows = lhs.shape[0]
    layout = _layout(group_sizes, rows, block)
    padded = jnp.pad(lhs, ((0, block), (0, 0)))  # [M + b, i]: every block slices b whole rows
    contract = 1 if transpose else 0

    def step(r, out):  # out [M + b, o]
        w = jax.lax.dynamic_index_in_dim(rhs, layout.group[r], keepdims=False)
        y = jax.lax.dot_general(
            _rows(padded, layout, r, block),
            w,
            (((1,), (contract,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
        return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), layout.first[r], 0)

    out = jnp.zeros((rows + block, rhs.shape[1 if transpose else 2]), lhs.dtype)
    return jax.lax.fori_loop(0, layout.used, step, out)[:rows]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, block: int) -> jax.Array:
    return _forward(lhs, rhs, group_sizes, block, transpose=False)


def _grouped_fwd(lhs, rhs, group_sizes, block):
    return _grouped(lhs, rhs, group_sizes, block), (lhs, rhs, group_sizes)


def _grouped_bwd(block, residuals, d_out):
    """d_lhs = grouped_matmul(d_out, rhs^T), d_rhs[g] = lhs_g^T · d_out_g block by block."""
    lhs, rhs, group_sizes = residuals
    d_out = d_out.astype(lhs.dtype)
    d_lhs = _forward(d_out, rhs, group_sizes, block, transpose=True)  # [M, N] · [N, K] per group
    layout = _layout(group_sizes, lhs.shape[0], block)
    padded_lhs = jnp.pad(lhs, ((0, block), (0, 0)))  # [M + b, K]
    padded_out = jnp.pad(d_out, ((0, block), (0, 0)))  # [M + b, N]

    def step(r, d_rhs):  # d_rhs [G, K, N] fp32
        x = _rows(padded_lhs, layout, r, block)  # [b, K], zero past the group: d_out's need not
        dy = jax.lax.dynamic_slice_in_dim(padded_out, layout.first[r], block)  # [b, N]
        part = jax.lax.dot_general(
            x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        g = layout.group[r]
        total = jax.lax.dynamic_index_in_dim(d_rhs, g, keepdims=False) + part
        return jax.lax.dynamic_update_index_in_dim(d_rhs, total, g, 0)

    d_rhs = jax.lax.fori_loop(0, layout.used, step, jnp.zeros(rhs.shape, jnp.float32))
    return d_lhs, d_rhs.astype(rhs.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
