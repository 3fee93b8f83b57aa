"""Attention across a sequence split over cp (context parallelism, meshtrain.parallel.context).

Each cp device holds its queries, keys and values for two chunks of the sequence (an early and
a late one, the context layout). Keys and values are all-gathered over cp (with grouped-query
attention they are the small half: K heads, not N) and put back in sequence order. Each of the
device's two chunks of queries then attends in blocks of queries (context_block: small enough
that a block's fp32 scores stay within SCORE_BYTES, and recomputed in the backward pass rather
than kept, so memory does not grow with T²), each block against a slice of keys ending at its
last query: under a causal mask as long as the latest chunk of its slot needs, with a sliding
window the window's length. Every device runs the same program (a branch per device would have
XLA allocate every branch's buffers side by side), whose masks take the true positions of its
chunks; the causal work each device needs is the same (ContextLayout.visible_pairs), and the
fixed slices compute about 1.4× that. The xla kernel attends each chunk to all the keys.

The backward pass is JAX's transpose of the same program: the gradients of the gathered keys
and values are reduce-scattered back over cp.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from meshtrain.models.attention import (
    AttentionKernel,
    WindowOfKind,
    chunk_queries,
    dot_product_attention,
    per_window,
)
from meshtrain.parallel.context import ContextLayout

# The fp32 scores of one block of queries against all the keys of the sequence stay within
# this many bytes (each block's scores are recomputed in the backward pass, not kept), so the
# attention's memory does not grow with the square of the sequence: 64 MiB, in blocks of at
# least 16 queries.
SCORE_BYTES = 64 * 2**20
MIN_BLOCK = 16


def context_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    layout: ContextLayout,
    kernel: AttentionKernel,
    scale: float,
    window: int | WindowOfKind | None = None,
    segment_ids: jax.Array | None = None,
    batch_axes: tuple[str, ...] = (),
    manual_axes: tuple[str, ...] = (),
) -> jax.Array:
    """Causal self-attention of sequences in the context layout, split over layout.axes along
    T (and over `batch_axes` along B): q [B, T, N, H], k, v [B, T, K, H], segment_ids optional
    int32 [B, T], as models.attention.dot_product_attention, which it equals → [B, T, N, H] in
    the layout."""
    if kernel == "cudnn":
        raise ValueError("cuDNN attention cannot offset a cp chunk's queries; use chunked")
    block = context_block(layout, batch=q.shape[0], heads=q.shape[2])
    attend = partial(
        _sharded,
        layout=layout,
        kernel=kernel,
        scale=scale,
        block=block,
        batch_axes=batch_axes,
        manual_axes=manual_axes,
    )
    return per_window(attend, window, q, k, v, segment_ids)


def context_block(layout: ContextLayout, *, batch: int, heads: int) -> int:
    """Queries per block of a cp chunk: those of the whole sequence (chunk_queries), fewer
    where a block's fp32 scores against every key [batch, heads, block, T] would exceed
    SCORE_BYTES (a power of two, at least MIN_BLOCK), and at most a chunk."""
    fits = SCORE_BYTES // (4 * batch * heads * layout.length)
    bounded = max(MIN_BLOCK, 2 ** max(0, fits.bit_length() - 1))
    return min(chunk_queries(layout.length), bounded, layout.chunk)


def _sharded(
    q, k, v, segment_ids, *, layout, kernel, scale, block, batch_axes, manual_axes, window
):
    # Manual over the batch axes too: each row attends on its own, and a pass run per device
    # group of some batch axes (jax.vmap with spmd_axis_name: train.gradients) needs them so.
    axes = layout.axes
    split = PartitionSpec(batch_axes or None, axes)

    def local(q, k, v, segment_ids):
        # q [B, 2c, N, H]: this device's early chunk, then its late one; k, v [B, 2c, K, H].
        whole = partial(jax.lax.all_gather, axis_name=axes, axis=1, tiled=True)
        keys, values = layout.to_sequence(whole(k)), layout.to_sequence(whole(v))
        segments = None if segment_ids is None else layout.to_sequence(whole(segment_ids))
        c, last = layout.chunk, 2 * layout.shards - 1
        outputs = []
        # The early chunk is one of 0 … cp - 1, the late one of cp … 2·cp - 1: each attends
        # to the keys up to its last query, sliced for the latest chunk of its slot.
        for slot, (chunk, latest) in enumerate(
            zip(layout.chunks(jax.lax.axis_index(axes)), (layout.shards - 1, last), strict=True)
        ):
            outputs.append(
                dot_product_attention(
                    q[:, slot * c : (slot + 1) * c],
                    keys,
                    values,
                    kernel=kernel,
                    scale=scale,
                    window=window,
                    segment_ids=segments,
                    block=block,
                    query_start=(chunk * c, latest * c),
                )
            )
        return jnp.concatenate(outputs, axis=1)

    specs = (split, split, split, None if segment_ids is None else split)
    return jax.shard_map(
        local,
        in_specs=specs,
        out_specs=split,
        axis_names={*axes, *batch_axes, *manual_axes},
        check_vma=False,
    )(q, k, v, segment_ids)
