"""Scaled dot-product attention: one function for every layer, with an implementation switch.

`model.attention` (auto, xla or cudnn) names what the user asks for; `select_attention` turns it
into one of the kernels below, once per model and compute dtype, with the reason:

    xla      jax.nn.dot_product_attention(implementation="xla"): the whole [T, S] score matrix
             of each head at once, softmax in fp32.
    chunked  the same call on blocks of queries, each against only the keys it can see (keys
             after the block's last query, or before the window of its first, are never
             computed): about half the work of `xla` for causal attention, and O(T · window) for
             sliding windows; for T ≤ one block (64 queries) it is `xla` itself. Pure XLA:
             the blocks unrolled on CPU, in loops when compiled for a GPU (chunk_groups).
    cudnn    jax.nn.dot_product_attention(implementation="cudnn"): cuDNN's fused flash
             attention, which never materialises the scores; NVIDIA GPUs, bf16/fp16 only.

`auto` picks cudnn on an NVIDIA GPU in bf16/fp16 when the head dimension allows it (a multiple
of 8, ≤ 256 on Hopper and Blackwell with a recent cuDNN, ≤ 128 elsewhere: cudnn_head_dim_limit),
and chunked otherwise. The GPU is the one the program is compiled for (meshtrain.parallel.target),
so a GPU program compiled from a CPU host picks what a GPU host would.

Every kernel computes the same masks: causal (a query sees keys at or before it), an optional
sliding window (query t sees keys s with t - window < s ≤ t, Hugging Face's convention) and
optional segment ids (int32 [B, T]: a query sees only keys of its own segment, so packed
documents do not attend to each other). Keys and values may have fewer heads than the queries
(grouped-query attention, K = 1 included): query head n reads key/value head n // (N / K).
Masked keys get probability exactly 0 in every kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.config.schema import AttentionImpl
from meshtrain.errors import ConfigError
from meshtrain.parallel.target import TargetDevice, cudnn_version, target_device

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
_HALF_PRECISION = (jnp.bfloat16, jnp.float16)


@dataclass(frozen=True)
class WindowOfKind:
    """The sliding window of a layer whose kind is traced (a scan over stacked layers of
    several kinds): windows[kind], each entry an int or None (full causal). Only the attention
    itself branches on the kind: the rest of the layer, and any collective in it, runs the same
    on every device, whatever kind each holds (pipeline stages run layers of different kinds
    at the same step of their scans)."""

    kind: jax.Array  # int32 scalar
    windows: tuple[int | None, ...]


def cudnn_head_dim_limit(target: TargetDevice, version: int | None) -> int:
    """The largest head_dim cuDNN's flash attention trains (forward and backward) on `target`:

    - 256 on Hopper (compute capability 9.x) with cuDNN >= 9.13: JAX's own check allows 256
      there (jax._src.cudnn, check_is_flash_attention), and cuDNN 9.11 and 9.12 mis-checked
      large head dims in Hopper's backward pass (cudnn-frontend 1.14.1 release notes);
    - 256 on Blackwell (10.x and later) with cuDNN >= 9.23, the first with a d=256 backward
      kernel there (cudnn-frontend 1.24.1 release notes);
    - 128 everywhere else (Ampere, Ada, older cuDNN, or a version that cannot be read).
    """
    capability = target.compute_capability
    if capability is None or version is None:
        return 128
    if capability[0] == 9 and version >= 91300:
        return 256
    if capability[0] >= 10 and version >= 92300:
        return 256
    return 128


def check_attention(requested: str, device: jax.Device | None = None) -> None:
    """Start-up check of model.attention against the devices: cudnn needs an NVIDIA GPU."""
    if requested == "cudnn" and not target_device(device).nvidia_gpu:
        raise ConfigError("model.attention=cudnn needs an NVIDIA GPU; use auto or xla")


def cudnn_unsupported(
    dtype: jnp.dtype, head_dim: int, target: TargetDevice, version: int | None
) -> str | None:
    """Why cuDNN's flash attention cannot run these shapes on `target` with cuDNN `version`
    (None: it can)."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _HALF_PRECISION]:
        return (
            f"cuDNN flash attention needs bf16/fp16, the compute dtype is {jnp.dtype(dtype).name}"
        )
    limit = cudnn_head_dim_limit(target, version)
    if head_dim > limit or head_dim % 8:
        shown = "unknown" if version is None else f"{version // 10000}.{version // 100 % 100}"
        return (
            f"cuDNN {shown} on {target.describe()} needs head_dim <= {limit} and a multiple "
            f"of 8, got {head_dim}"
        )
    return None


def select_attention(
    requested: AttentionImpl | str,
    *,
    dtype: jnp.dtype,
    head_dim: int,
    device: jax.Device | None = None,
) -> tuple[AttentionKernel, str]:
    """(kernel, why) for model.attention=`requested` in this compute dtype on the device the
    program is compiled for (`device`, else parallel.target.target_device())."""
    if requested == "xla":
        return "xla", "model.attention=xla"
    if requested == "cudnn":
        check_attention(requested, device)
        return "cudnn", "model.attention=cudnn"
    target = target_device(device)
    if not target.nvidia_gpu:
        return "chunked", f"auto: cuDNN needs an NVIDIA GPU, this is {target.describe()}"
    version = cudnn_version()
    reason = cudnn_unsupported(dtype, head_dim, target, version)
    if reason is not None:
        return "chunked", f"auto: {reason}"
    return "cudnn", f"auto: {target.describe()}, {jnp.dtype(dtype).name}, head_dim {head_dim}"


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
        mask = mask & (segment_ids[:, None, :, None] == keys[:, None, None, :])
    return mask


def chunk_queries(length: int) -> int:
    """Queries per block of the chunked kernel for a sequence of `length`."""
    return max(MIN_CHUNK_QUERIES, -(-length // CHUNK_BLOCKS))


def _xla(q, k, v, *, scale, mask, implementation="xla"):
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, implementation=implementation
    )


def _plain(q, k, v, *, scale, window, segment_ids):
    """The xla kernel: one call over the whole sequence."""
    length = q.shape[1]
    positions = jnp.arange(length)
    mask = attention_mask(positions, positions, window=window, segment_ids=segment_ids)
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


def _chunked(q, k, v, *, scale, window, segment_ids, block: int):
    """The chunked kernel: its blocks unrolled on CPU, where XLA compiles them quickly and runs
    them 1.3-1.5× faster than loops (T = 2048 and 4096, forward and backward:
    docs/performance.md); looped elsewhere, where XLA's GPU compiler took 9 minutes over Gemma 3
    1B's 26 layers × 16 unrolled blocks."""
    if q.shape[1] <= block:
        return _plain(q, k, v, scale=scale, window=window, segment_ids=segment_ids)
    chunked = _chunked_unrolled if target_device().platform == "cpu" else _chunked_loop
    return chunked(q, k, v, scale=scale, window=window, segment_ids=segment_ids, block=block)


def _chunked_unrolled(q, k, v, *, scale, window, segment_ids, block: int):
    """Query blocks of `block` positions, each against the keys it can see only (static slices,
    so the skipped blocks cost nothing), each block its own code. The softmax of a block runs
    over exactly the keys that are not masked for some query of it, so the result equals the
    whole-sequence one."""
    length = q.shape[1]
    outputs = []
    for start in range(0, length, block):
        stop = min(start + block, length)
        first_key = 0 if window is None else max(0, start - window + 1)
        mask = attention_mask(
            jnp.arange(start, stop),
            jnp.arange(first_key, stop),
            window=window,
            segment_ids=None if segment_ids is None else segment_ids[:, start:stop],
            key_segment_ids=None if segment_ids is None else segment_ids[:, first_key:stop],
        )
        outputs.append(
            _xla(
                q[:, start:stop],
                k[:, first_key:stop],
                v[:, first_key:stop],
                scale=scale,
                mask=mask,
            )
        )
    return jnp.concatenate(outputs, axis=1)


def _chunked_loop(q, k, v, *, scale, window, segment_ids, block: int):
    """Query blocks of `block` positions, each against the keys it can see only: the blocks of
    a group (chunk_groups) run in one loop, each against a slice of keys as long as the group
    needs, ending at the block's last query (keys after it, or before the window of its first,
    are never computed). The softmax of a block runs over keys that are masked or visible to
    the same queries as in the whole-sequence kernel, so the result is the same. The sequence
    is padded to whole blocks; padded queries repeat the last position and are dropped."""
    batch, length = q.shape[:2]
    blocks = -(-length // block)
    padded = blocks * block - length
    q = jnp.pad(q, ((0, 0), (0, padded), (0, 0), (0, 0)))
    query_segments = None
    if segment_ids is not None:
        query_segments = jnp.pad(segment_ids, ((0, 0), (0, padded)), mode="edge")
    outputs = []
    for group in chunk_groups(blocks, window):
        span = min(length, (group.stop * block) if window is None else window - 1 + block)

        def one_block(start, span=span):
            stop = jnp.minimum(start + block, length)
            first_key = jnp.maximum(0, stop - span)  # 0 for full causal attention
            query_positions = jnp.minimum(start + jnp.arange(block), length - 1)
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
        out = jax.lax.map(one_block, starts)  # [blocks of the group, B, block, N, H]
        outputs.append(jnp.moveaxis(out, 0, 1).reshape(batch, len(group) * block, *q.shape[2:]))
    return jnp.concatenate(outputs, axis=1)[:, :length]


def _cudnn(q, k, v, *, scale, window, segment_ids):
    # cuDNN builds the causal and window masks itself (without materialising them); segments
    # come as a boolean mask, which jax turns into a bias.
    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
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
) -> jax.Array:
    """Causal self-attention. q: [B, T, N, H]; k, v: [B, T, K, H] with K dividing N;
    segment_ids: optional int32 [B, T]; window: optional sliding window (keys per query, itself
    included), or the windows of a traced layer kind (WindowOfKind). Returns [B, T, N, H] in q's
    dtype; scores are scaled by `scale` (default 1/sqrt(H)) and the softmax runs in fp32. block: queries per block of the chunked kernel
    (default: chunk_queries(T))."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if isinstance(window, WindowOfKind):
        attend = partial(
            dot_product_attention, kernel=kernel, scale=scale, segment_ids=segment_ids, block=block
        )
        if len(set(window.windows)) == 1:
            return attend(q, k, v, window=window.windows[0])
        branches = [partial(attend, window=w) for w in window.windows]
        return jax.lax.switch(window.kind, branches, q, k, v)
    if kernel == "xla":
        return _plain(q, k, v, scale=scale, window=window, segment_ids=segment_ids)
    if kernel == "chunked":
        block = chunk_queries(q.shape[1]) if block is None else block
        return _chunked(q, k, v, scale=scale, window=window, segment_ids=segment_ids, block=block)
    if kernel == "cudnn":
        return _cudnn(q, k, v, scale=scale, window=window, segment_ids=segment_ids)
    raise ValueError(f"unknown attention kernel {kernel!r}; use xla, chunked or cudnn")
