"""Scaled dot-product attention: one function for every layer, with an implementation switch.

`model.attention` (auto, xla or cudnn) names what the user asks for;
meshtrain.models.attention_choice's `select_attention` turns it into one of the kernels below,
once per model and compute dtype, with the reason:

    xla      jax.nn.dot_product_attention(implementation="xla"): the whole [T, S] score matrix
             of each head at once, softmax in fp32.
    chunked  the same call on blocks of queries, each against only the keys it can see (keys
             after the block's last query, or before the window of its first, are never
             computed): about half the work of `xla` for causal attention, and O(T · window) for
             sliding windows; for T ≤ one block (64 queries) it is `xla` itself. Pure XLA:
             the blocks unrolled on CPU, in loops when compiled for a GPU (chunk_groups).
    cudnn    jax.nn.dot_product_attention(implementation="cudnn"): cuDNN's fused flash
             attention, which never materialises the scores; NVIDIA GPUs, bf16/fp16 only.

Every kernel computes the same masks: causal (a query sees keys at or before it), an optional
sliding window (query t sees keys s with t - window < s ≤ t, Hugging Face's convention) and
optional segment ids (int32 [B, T]: a query sees only keys of its own segment, so packed
documents do not attend to each other; see `same_document` for a segment's branches). Keys and
values may have fewer heads than the queries (grouped-query attention, K = 1 included): query
head n reads key/value head n // (N / K).
Masked keys get probability exactly 0 in every kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.hardware.target import target_device

AttentionKernel = Literal["xla", "chunked", "cudnn"]
"""What actually runs (see the module docstring); `select_attention` maps model.attention to one."""

# Queries per block of the chunked kernel: the sequence in at most CHUNK_BLOCKS blocks (a
# bounded program; causal attention then computes (n + 1) / 2n of the full score matrix), of at
# least MIN_CHUNK_QUERIES queries (smaller blocks cost more in overhead than they skip).
# Measured on one CPU core, fwd + bwd of causal attention with 4 heads of 64: T=256 in blocks
# of 64 takes 0.66× the time of the xla kernel, T=2048 in blocks of 256 0.54×.
CHUNK_BLOCKS = 16
MIN_CHUNK_QUERIES = 64
# Loops of query blocks for full causal attention (chunk_groups): a compiled program holds
# CHUNK_GROUPS loop bodies per layer, not one block of code per block of queries.
CHUNK_GROUPS = 4


# A segment id's bits from BRANCH_SHIFT up number its token's branch within the document: 0 for
# the document's shared start, 1, 2... for branches that each see that start and themselves, not
# one another (a pair's two answers after their prompt, written once: train.documents). Text and
# chat data have branch 0 everywhere, where same_document is plain equality of segment ids.
BRANCH_SHIFT = 24
DOCUMENT_BITS = (1 << BRANCH_SHIFT) - 1


def with_branches(segment_ids: jax.Array, branches: jax.Array) -> jax.Array:
    """Segment ids int32 [B, T] (documents counted from 1, below 2**24) and each token's branch
    int32 [B, T] (0: the document's shared start) as one segment id per token."""
    return segment_ids | (branches << BRANCH_SHIFT)


def same_document(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
    """bool [B, 1, T, S]: whether query t may see key s by their segment ids int32 [B, T],
    [B, S]: same segment, or the key in its document's shared start (branch 0)."""
    queries, keys = query_segments[:, None, :, None], key_segments[:, None, None, :]
    shared_start = ((keys >> BRANCH_SHIFT) == 0) & ((queries & DOCUMENT_BITS) == keys)
    return (queries == keys) | shared_start


@dataclass(frozen=True)
class WindowOfKind:
    """The sliding window of a layer whose kind is traced (a scan over stacked layers of
    several kinds): windows[kind], each entry an int or None (full causal). Only the attention
    itself branches on the kind: the rest of the layer, and any collective in it, runs the same
    on every device, whatever kind each holds (pipeline stages run layers of different kinds
    at the same step of their scans)."""

    kind: jax.Array  # int32 scalar
    windows: tuple[int | None, ...]


def attention_mask(
    query_positions: jax.Array,
    key_positions: jax.Array,
    *,
    window: int | None,
    segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
) -> jax.Array:
    """bool [1 or B, 1, T, S]: causal, windowed and same-segment; positions are indices [T], [S]."""
    t, s = query_positions[:, None], key_positions[None, :]
    mask = s <= t
    if window is not None:
        mask = mask & (s > t - window)
    mask = mask[None, None]  # [1, 1, T, S]
    if segment_ids is not None:
        keys = segment_ids if key_segment_ids is None else key_segment_ids
        mask = mask & same_document(segment_ids, keys)
    return mask


def chunk_queries(length: int) -> int:
    """Queries per block of the chunked kernel for a sequence of `length`."""
    return max(MIN_CHUNK_QUERIES, -(-length // CHUNK_BLOCKS))


def _xla(q, k, v, *, scale, mask, implementation="xla"):
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, implementation=implementation
    )


# Where the queries sit among the keys: (the key index of the first query, traced or not;
# the largest value it can take, static). None: the queries are the last of the keys.
QueryStart = tuple[jax.Array | int, int] | None


def _first_query(queries: int, keys: int, start: QueryStart) -> tuple[jax.Array | int, int]:
    return (keys - queries, keys - queries) if start is None else start


def _query_segments(segment_ids: jax.Array | None, queries: int, first: Any) -> jax.Array | None:
    """The segment ids of the `queries` queries, the first at key index `first`."""
    if segment_ids is None:
        return None
    return jax.lax.dynamic_slice_in_dim(segment_ids, first, queries, axis=1)


def _plain(q, k, v, *, scale, window, segment_ids, start: QueryStart = None):
    """The xla kernel: one call over all the queries and keys."""
    queries, keys = q.shape[1], k.shape[1]
    first, _ = _first_query(queries, keys, start)
    mask = attention_mask(
        first + jnp.arange(queries),
        jnp.arange(keys),
        window=window,
        segment_ids=_query_segments(segment_ids, queries, first),
        key_segment_ids=segment_ids,
    )
    return _xla(q, k, v, scale=scale, mask=mask)


def chunk_groups(blocks: int, window: int | None) -> list[range]:
    """The query blocks of the chunked kernel, in the groups each compiled as one loop: a
    sliding window needs the same number of keys for every block, so one group; full causal
    attention needs more keys the later the block, so CHUNK_GROUPS groups, each against the
    keys its last block sees (the work is (g + 1) / 2g of the whole score matrix for g groups,
    against (n + 1) / 2n for n blocks each on its own)."""
    groups = 1 if window is not None else min(CHUNK_GROUPS, blocks)
    bounds = [round(blocks * g / groups) for g in range(groups + 1)]
    return [range(bounds[g], bounds[g + 1]) for g in range(groups)]


def _chunked(q, k, v, *, scale, window, segment_ids, block: int, start: QueryStart = None):
    """The chunked kernel: its blocks unrolled on CPU, where XLA compiles them quickly and runs
    them 1.3-1.5× faster than loops (T = 2048 and 4096, forward and backward:
    docs/performance.md); looped elsewhere, where XLA's GPU compiler took 9 minutes over Gemma 3
    1B's 26 layers × 16 unrolled blocks. With a `start` (a cp chunk's, traced): looped
    everywhere, each block's scores recomputed in the backward pass rather than kept (memory:
    one block's, whatever T)."""
    if start is not None:
        return _chunked_loop(
            q,
            k,
            v,
            scale=scale,
            window=window,
            segment_ids=segment_ids,
            block=block,
            remat=True,
            start=start,
        )
    if q.shape[1] <= block:
        return _plain(q, k, v, scale=scale, window=window, segment_ids=segment_ids)
    chunked = _chunked_unrolled if target_device().platform == "cpu" else _chunked_loop
    return chunked(q, k, v, scale=scale, window=window, segment_ids=segment_ids, block=block)


def _chunked_unrolled(q, k, v, *, scale, window, segment_ids, block: int):
    """Query blocks of `block` positions, each against the keys it can see only (static slices,
    so the skipped blocks cost nothing), each block its own code. The softmax of a block runs
    over exactly the keys that are not masked for some query of it, so the result equals the
    whole-sequence one."""
    queries, keys = q.shape[1], k.shape[1]
    offset = keys - queries  # the key index of the first query
    outputs = []
    for start in range(0, queries, block):
        stop = min(start + block, queries)
        first, last = offset + start, offset + stop  # the block's queries, as key indices
        first_key = 0 if window is None else max(0, first - window + 1)
        mask = attention_mask(
            jnp.arange(first, last),
            jnp.arange(first_key, last),
            window=window,
            segment_ids=None if segment_ids is None else segment_ids[:, first:last],
            key_segment_ids=None if segment_ids is None else segment_ids[:, first_key:last],
        )
        outputs.append(
            _xla(
                q[:, start:stop],
                k[:, first_key:last],
                v[:, first_key:last],
                scale=scale,
                mask=mask,
            )
        )
    return jnp.concatenate(outputs, axis=1)


def _chunked_loop(
    q, k, v, *, scale, window, segment_ids, block: int, remat: bool = False, start=None
):
    """Query blocks of `block` positions, each against the keys it can see only: the blocks of
    a group (chunk_groups) run in one loop, each against a slice of keys as long as the group
    needs, ending at the block's last query (keys after it, or before the window of its first,
    are never computed). The softmax of a block runs over keys that are masked or visible to
    the same queries as in the whole-sequence kernel, so the result is the same. The queries
    are padded to whole blocks; padded queries repeat the last position and are dropped.
    remat: each block's scores are recomputed in the backward pass, not kept. start: where the
    queries sit (QueryStart): a traced first query sizes each group's keys for the latest."""
    (batch, queries), keys = q.shape[:2], k.shape[1]
    offset, latest = _first_query(queries, keys, start)  # the key index of the first query
    blocks = -(-queries // block)
    padded = blocks * block - queries
    q = jnp.pad(q, ((0, 0), (0, padded), (0, 0), (0, 0)))
    query_segments = _query_segments(segment_ids, queries, offset)
    if query_segments is not None:
        query_segments = jnp.pad(query_segments, ((0, 0), (0, padded)), mode="edge")
    outputs = []
    for group in chunk_groups(blocks, window):
        needed = latest + group.stop * block if window is None else window - 1 + block
        span = min(keys, needed)

        def one_block(start, span=span):
            stop = jnp.minimum(offset + start + block, keys)
            first_key = jnp.maximum(0, stop - span)  # 0 for full causal attention
            query_positions = jnp.minimum(offset + start + jnp.arange(block), keys - 1)
            mask = attention_mask(
                query_positions,
                first_key + jnp.arange(span),
                window=window,
                segment_ids=None
                if query_segments is None
                else jax.lax.dynamic_slice_in_dim(query_segments, start, block, axis=1),
                key_segment_ids=None
                if segment_ids is None
                else jax.lax.dynamic_slice_in_dim(segment_ids, first_key, span, axis=1),
            )
            return _xla(
                jax.lax.dynamic_slice_in_dim(q, start, block, axis=1),
                jax.lax.dynamic_slice_in_dim(k, first_key, span, axis=1),
                jax.lax.dynamic_slice_in_dim(v, first_key, span, axis=1),
                scale=scale,
                mask=mask,
            )

        starts = np.asarray([b * block for b in group], np.int32)
        run = jax.checkpoint(one_block) if remat else one_block  # remat: keep no scores
        out = jax.lax.map(run, starts)  # [blocks of the group, B, block, N, H]
        outputs.append(jnp.moveaxis(out, 0, 1).reshape(batch, len(group) * block, *q.shape[2:]))
    return jnp.concatenate(outputs, axis=1)[:, :queries]


def _cudnn(q, k, v, *, scale, window, segment_ids):
    if q.shape[1] != k.shape[1]:  # its causal mask aligns the first query with the first key
        raise ValueError("the cudnn kernel attends a whole sequence: as many queries as keys")
    # cuDNN builds the causal and window masks itself (without materialising them); segments
    # come as a boolean mask, which jax turns into a bias.
    mask = None
    if segment_ids is not None:
        mask = same_document(segment_ids, segment_ids)
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        scale=scale,
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn",
    )


def per_window(attend: Callable[..., jax.Array], window: Any, *operands: Any) -> jax.Array:
    """attend(*operands, window=w) with the sliding window w of a layer (an int or None), or
    of a traced layer kind (WindowOfKind: a lax.switch over the kinds' windows, each static in
    its branch)."""
    if not isinstance(window, WindowOfKind):
        return attend(*operands, window=window)
    if len(set(window.windows)) == 1:
        return attend(*operands, window=window.windows[0])
    branches = [partial(attend, window=w) for w in window.windows]
    return jax.lax.switch(window.kind, branches, *operands)


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    kernel: AttentionKernel,
    scale: float | None = None,
    window: int | WindowOfKind | None = None,
    segment_ids: jax.Array | None = None,
    block: int | None = None,
    query_start: QueryStart = None,
) -> jax.Array:
    """Causal self-attention. q: [B, T, N, H]; k, v: [B, S, K, H] with K dividing N and S ≥ T:
    the queries are the last T of the S key positions (S = T for a whole sequence; S > T for a
    chunk of queries after earlier keys, as context parallelism runs them:
    models.context_attention). segment_ids: optional int32 [B, S], of the keys (the queries'
    are the last T); window: optional sliding window (keys per query, itself included), or
    the windows of a traced layer kind (WindowOfKind). Returns [B, T, N, H] in q's dtype;
    scores are scaled by `scale` (default 1/sqrt(H)) and the softmax runs in fp32. block:
    queries per block of the chunked kernel (default: chunk_queries(T)); query_start: where
    the queries sit among the keys, if not last (QueryStart: xla and chunked; the chunked
    kernel then loops over its blocks, each block's scores recomputed in the backward pass, so
    that a long sequence's attention keeps one block's scores at a time)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    def attend(q, k, v, segment_ids, *, window):
        if kernel == "xla":
            return _plain(
                q, k, v, scale=scale, window=window, segment_ids=segment_ids, start=query_start
            )
        if kernel == "chunked":
            size = chunk_queries(q.shape[1]) if block is None else block
            return _chunked(
                q,
                k,
                v,
                scale=scale,
                window=window,
                segment_ids=segment_ids,
                block=size,
                start=query_start,
            )
        if kernel == "cudnn":
            return _cudnn(q, k, v, scale=scale, window=window, segment_ids=segment_ids)
        raise ValueError(f"unknown attention kernel {kernel!r}; use xla, chunked or cudnn")

    return per_window(attend, window, q, k, v, segment_ids)
