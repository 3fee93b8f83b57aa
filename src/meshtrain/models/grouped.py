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
    512, N = 1024 with G = 8 or 64 even groups, b = 128 was at or near the fastest of 64, 128
    and 256, forward and backward.
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
    """Where each row goes in the padded, blocked order (b rows per block, R blocks)."""

    used: jax.Array  # int32 []: the blocks the groups use, at most R, the first of them
    group: jax.Array  # int32 [R]: each block's group, G - 1 for the unused blocks
    source: jax.Array  # int32 [R, b]: the row of lhs each padded row reads (clipped to M - 1)
    valid: jax.Array  # bool [R, b]: the padded rows that hold a row of lhs
    target: jax.Array  # int32 [M]: each row's padded position (block · b + offset)
    counted: jax.Array  # bool [M]: the rows that belong to a group (below sum(group_sizes))


def _layout(group_sizes: jax.Array, rows: int, block: int) -> _Layout:
    groups = group_sizes.shape[0]
    num_blocks = -(-rows // block) + min(groups, rows) - 1  # R >= sum(ceil(size_g / b))
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), rows)  # [G]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # [G]
    block_ends = jnp.cumsum((ends - starts + block - 1) // block)  # [G]
    block_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), block_ends[:-1]])  # [G]
    index = jnp.arange(num_blocks, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(block_ends, index, side="right"), groups - 1)  # [R]
    first = starts[group] + (index - block_starts[group]) * block  # [R]: the block's first row
    source = first[:, None] + jnp.arange(block, dtype=jnp.int32)  # [R, b]
    used = block_ends[-1]
    valid = (source < ends[group][:, None]) & (index < used)[:, None]
    row = jnp.arange(rows, dtype=jnp.int32)
    row_group = jnp.searchsorted(ends, row, side="right")  # [M], G past the groups' rows
    counted = row_group < groups
    row_group = jnp.minimum(row_group, groups - 1)
    target = block_starts[row_group] * block + row - starts[row_group]
    return _Layout(
        used.astype(jnp.int32),
        group.astype(jnp.int32),
        jnp.minimum(source, rows - 1),
        valid,
        jnp.where(counted, target, 0).astype(jnp.int32),
        counted,
    )


def _pad(x: jax.Array, layout: _Layout) -> jax.Array:
    """[M, i] → [R, b, i], each group's rows padded with zeros to whole blocks."""
    return jnp.where(layout.valid[..., None], x[layout.source], jnp.zeros((), x.dtype))


def _unpad(padded: jax.Array, layout: _Layout) -> jax.Array:
    """[R, b, o] → [M, o], zeros for the rows past the groups'."""
    flat = padded.reshape(-1, padded.shape[-1])
    return jnp.where(layout.counted[:, None], flat[layout.target], jnp.zeros((), flat.dtype))


def _blocks_times(padded: jax.Array, rhs: jax.Array, layout: _Layout, transpose: bool) -> jax.Array:
    """Block r of padded [R, b, i] times its group's rhs [i, o] (rhs [G, i, o]; with transpose,
    rhs [G, o, i] transposed) → [R, b, o] in padded's dtype, the unused blocks zero."""
    num_blocks, block, _ = padded.shape
    width = rhs.shape[1] if transpose else rhs.shape[2]
    contract = 1 if transpose else 0

    def step(r, out):
        w = jax.lax.dynamic_index_in_dim(rhs, layout.group[r], keepdims=False)
        x = jax.lax.dynamic_index_in_dim(padded, r, keepdims=False)
        y = jax.lax.dot_general(
            x, w, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32
        )
        return jax.lax.dynamic_update_index_in_dim(out, y.astype(out.dtype), r, 0)

    out = jnp.zeros((num_blocks, block, width), padded.dtype)
    return jax.lax.fori_loop(0, layout.used, step, out)


def _forward(lhs: jax.Array, rhs: jax.Array, layout: _Layout, transpose: bool) -> jax.Array:
    return _unpad(_blocks_times(_pad(lhs, layout), rhs, layout, transpose), layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, block: int) -> jax.Array:
    return _forward(lhs, rhs, _layout(group_sizes, lhs.shape[0], block), transpose=False)


def _grouped_fwd(lhs, rhs, group_sizes, block):
    return _grouped(lhs, rhs, group_sizes, block), (lhs, rhs, group_sizes)


def _grouped_bwd(block, residuals, d_out):
    lhs, rhs, group_sizes = residuals
    layout = _layout(group_sizes, lhs.shape[0], block)
    d_out = d_out.astype(lhs.dtype)
    d_lhs = _forward(d_out, rhs, layout, transpose=True)  # [M, N] · rhs[g]^T [N, K]
    padded_lhs, padded_out = _pad(lhs, layout), _pad(d_out, layout)  # [R, b, K], [R, b, N]

    def step(r, d_rhs):  # d_rhs [G, K, N] fp32
        x = jax.lax.dynamic_index_in_dim(padded_lhs, r, keepdims=False)
        dy = jax.lax.dynamic_index_in_dim(padded_out, r, keepdims=False)
        g = layout.group[r]
        part = jax.lax.dot_general(
            x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        total = jax.lax.dynamic_index_in_dim(d_rhs, g, keepdims=False) + part
        return jax.lax.dynamic_update_index_in_dim(d_rhs, total, g, 0)

    d_rhs = jax.lax.fori_loop(0, layout.used, step, jnp.zeros(rhs.shape, jnp.float32))
    return d_lhs, d_rhs.astype(rhs.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
