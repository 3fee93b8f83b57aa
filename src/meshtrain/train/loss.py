"""The loss: the model's output projection fused with the cross-entropy, in chunks of tokens.

No [B, T, V] log-probabilities are materialised, nor logits kept for the backward pass; when the
micro-batch has fewer tokens than the vocabulary, the tokens move instead of the output weight.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from meshtrain.parallel.context import sequence_shards
from meshtrain.parallel.rules import active_axes, constrain, mesh_axes_for

# Tokens per device in one chunk of the fused output projection + cross-entropy: the fp32
# logits of a chunk are [rows, V] (W1, V=32000: 64 MB), never those of the whole batch.
LOSS_CHUNK_ROWS = 512


def _batch_shards(batch: int, rules: Any) -> int:
    """Devices the batch is split over in the current mesh (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    shards = math.prod(mesh.shape[a] for a in mesh_axes_for("batch", rules) if a in mesh.shape)
    return shards if batch % shards == 0 else 1


def _vocab_parallel_rules(batch: int, length: int, vocab: int, rules: Any) -> Any | None:
    """Rules under which the loss keeps the output weight where it is and moves tokens instead,
    or None when gathering the weight is cheaper.

    By default the weight [V, D] is gathered over the batch axes (fsdp, dp) for the logits and
    its gradient reduced over them: V·D elements each way. When the global micro-batch holds
    fewer tokens than the vocabulary has rows, it is cheaper to gather the tokens (B·T·D) and
    split the vocabulary over the batch axes as well as its own: each device then computes the
    logits of every token for V / (all those axes) rows, its weight gradient needs no reduction,
    and dx is reduced back to the token shards (B·T·D). The result is the same sum.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    batch_axes = active_axes(mesh_axes_for("batch", rules), mesh.shape)
    vocab_axes = active_axes(mesh_axes_for("vocab", rules), mesh.shape)
    split = math.prod(mesh.shape[a] for a in (*batch_axes, *vocab_axes))
    if _batch_shards(batch, rules) == 1 or batch * length >= vocab or vocab % split:
        return None
    return {**rules, "batch": None, "vocab": [*vocab_axes, *batch_axes]}


def _whole_over_experts(vocab_parallel: Any) -> Any:
    """The vocabulary-parallel rules with the vocabulary no longer split over the experts' axes
    (ep, the last of the batch axes it is split over), along which the output weight is whole:
    its gradient is gathered over ep first, then resharded as without ep (XLA, asked to go from
    a vocabulary split over (fsdp, ep) to d_model over fsdp in one step, replicates it)."""
    experts = mesh_axes_for("experts", vocab_parallel) if "experts" in vocab_parallel else ()
    vocab = [a for a in mesh_axes_for("vocab", vocab_parallel) if a not in experts]
    return {**vocab_parallel, "vocab": vocab}


def _sequence_pieces(length: int, rules: Any) -> int:
    """Devices each sequence is split over in the current mesh (cp), where they divide it."""
    mesh = jax.sharding.get_abstract_mesh()
    pieces = 1 if mesh.empty else sequence_shards(mesh.shape, rules)
    return pieces if length % pieces == 0 else 1


def _target_logits(logits: jax.Array, targets: jax.Array, rows_split: bool) -> jax.Array:
    """logits fp32 [B, c, V], targets int32 [B, c] → the targets' logits fp32 [B, c];
    `rows_split`: the rows B are split over a batch axis (dp, fsdp).

    A gather reads B·c logits, where a one-hot select reads all B·c·V (6% of W1's step). Inside
    a shard_map that is manual over some mesh axes (the pp stages of 1f1b, whose loss runs in
    the pipeline), XLA's SPMD partitioner aborts on that gather when the rows are split over a
    batch axis and the vocabulary over tp ("Check failed: partition_group_list..." in
    ExpandDeviceGroupsWithIota, jax 0.10 to 0.12): there the select, which partitions as any
    elementwise op and a reduction, takes its place; everywhere else the gather is cheaper."""
    if rows_split and jax.sharding.get_abstract_mesh().manual_axes:
        hit = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
        return jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def output_cross_entropy(
    x: jax.Array,
    weight: jax.Array,
    layout: str,
    targets: jax.Array,
    mask: jax.Array,
    *,
    rules: Any,
    chunk_rows: int | None = None,
) -> jax.Array:
    """Summed cross-entropy of the output projection, fused: x [B, T, D] (final-normed hidden
    states), weight [V, D] (layout "VD", tied) or [D, V] ("DV"), targets int32 [B, T], mask [B, T]
    (1: counted) → fp32 []. Equals -sum(mask · log_softmax(x · weight)[targets]) in fp32.

    The sequence is cut into chunks of about `chunk_rows` (default LOSS_CHUNK_ROWS) tokens per
    device. For each chunk the
    logits are computed in the compute dtype, then in fp32 their log-sum-exp, the target's logit
    and, when differentiated, the gradient softmax - onehot, which goes straight into the
    chunk's dx and into dW. No [B, T, V] array is kept for the backward pass (only dx and dW
    are), and no log-probabilities are materialised. dW is summed over the chunks per batch
    shard ([shards, D, V], no collective inside the loop); the one reduction over the batch
    shards follows the loop, as in the unfused backward pass. When the micro-batch has fewer
    tokens than the vocabulary, the tokens move instead of the weight (_vocab_parallel_rules).
    """
    batch, length, _ = x.shape
    vocab = weight.shape[0 if layout == "VD" else 1]
    # `inner`: the shardings inside the chunk loop; dx and dW leave it in those of `rules`.
    vocab_parallel = _vocab_parallel_rules(batch, length, vocab, rules)
    inner = vocab_parallel or rules
    shards = 1 if vocab_parallel else _batch_shards(batch, rules)
    chunk_rows = LOSS_CHUNK_ROWS if chunk_rows is None else chunk_rows
    per_chunk = max(1, chunk_rows // max(1, batch // shards))
    # Split over cp (s devices), each chunk takes its tokens from every device's part of the
    # sequence: [B, s · chunk], s major, so that no chunk moves tokens between devices.
    pieces = _sequence_pieces(length, rules)
    local = length // pieces
    num_chunks = -(-local // per_chunk)
    chunk = -(-local // num_chunks)
    padded = num_chunks * chunk
    weight_axes = ("vocab", "embed") if layout == "VD" else ("embed", "vocab")
    gathered_axes = ("vocab", None) if layout == "VD" else (None, "vocab")
    partial_spec = "SVD" if layout == "VD" else "SDV"
    partial_axes = ("batch", "vocab", None) if layout == "VD" else ("batch", None, "vocab")
    mask = mask.astype(jnp.float32)

    def split(a: jax.Array) -> jax.Array:  # [B, T, ...] → [chunks, B, s · chunk, ...]
        rest = a.shape[2:]
        a = a.reshape(batch, pieces, local, *rest)
        if padded != local:
            pad = [(0, 0), (0, 0), (0, padded - local)] + [(0, 0)] * len(rest)
            a = jnp.pad(a, pad)  # padded targets count 0: no loss, no gradient
        a = jnp.moveaxis(a.reshape(batch, pieces, num_chunks, chunk, *rest), 2, 0)
        return a.reshape(num_chunks, batch, pieces * chunk, *rest)

    def chunk_loss(weight, xc, tc, mc, grads: bool):
        logits = jnp.einsum(f"BTD,{layout}->BTV", xc, weight)
        logits = constrain(logits, ("batch", "length", "vocab"), inner).astype(jnp.float32)
        top = jnp.max(logits, axis=-1, keepdims=True)
        # log-sum-exp [B, c, 1]; exp(logits - top) is fused into the sum, never stored.
        lse = top + jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True))
        target_logit = _target_logits(logits, tc, shards > 1)
        loss = jnp.sum((lse[..., 0] - target_logit) * mc, axis=-1)  # [B]: summed at the end
        if not grads:
            return loss, None, None
        # d loss / d logits = softmax - onehot, in one elementwise pass over the logits.
        onehot = jnp.arange(vocab, dtype=tc.dtype) == tc[..., None]  # [B, c, V]
        dlogits = ((jnp.exp(logits - lse) - onehot) * mc[..., None]).astype(weight.dtype)
        dx = jnp.einsum(f"BTV,{layout}->BTD", dlogits, weight)
        dx = constrain(dx, ("batch", "length", None), inner)
        rows = (shards, batch // shards, pieces * chunk)
        dweight = jnp.einsum(
            f"SBTD,SBTV->{partial_spec}",
            xc.reshape(*rows, xc.shape[-1]),
            dlogits.reshape(*rows, vocab),
            preferred_element_type=jnp.float32,
        )
        return loss, dx, constrain(dweight, partial_axes, inner)

    def run(x, weight, targets, mask, grads: bool):
        # Gathered over fsdp once, before the chunks (each would otherwise gather it again);
        # vocabulary-parallel, the tokens are gathered instead and the weight only re-split.
        weight = constrain(weight, gathered_axes, inner)
        if vocab_parallel:
            x, targets, mask = (
                constrain(a, ("batch", "length", None)[: a.ndim], inner) for a in (x, targets, mask)
            )
        xs, ts, ms = split(x), split(targets), split(mask)
        # The first chunk starts the sums (no zero-filled [shards, D, V] buffer); a scan runs
        # the others.
        loss, dx, dweight = chunk_loss(weight, xs[0], ts[0], ms[0], grads)
        dxs = None if dx is None else dx[None]
        if num_chunks > 1:

            def body(carry, inputs):
                loss_sum, dweight_sum = carry
                loss, dx, dweight = chunk_loss(weight, *inputs, grads)
                if grads:
                    dweight_sum = dweight_sum + dweight
                return (loss_sum + loss, dweight_sum), dx

            (loss, dweight), rest = jax.lax.scan(body, (loss, dweight), (xs[1:], ts[1:], ms[1:]))
            if grads:
                dxs = jnp.concatenate([dxs, rest])
        loss = jnp.sum(loss)
        if not grads:
            return loss, None
        dx = dxs.reshape(num_chunks, batch, pieces, chunk, -1)  # split's inverse
        dx = jnp.moveaxis(dx, 0, 2).reshape(batch, pieces, padded, -1)[:, :, :local]
        dx = dx.reshape(batch, length, -1)
        dx = constrain(dx, ("batch", "length", None), rules)
        dweight = jnp.sum(dweight, axis=0).astype(weight.dtype)
        if vocab_parallel:
            dweight = constrain(dweight, gathered_axes, _whole_over_experts(inner))
        dweight = constrain(dweight, weight_axes, rules)
        return loss, (dx, dweight)

    @jax.custom_vjp
    def fused(x, weight, targets, mask):
        return run(x, weight, targets, mask, grads=False)[0]

    def fused_fwd(x, weight, targets, mask):
        return run(x, weight, targets, mask, grads=True)

    def fused_bwd(grads, g):
        dx, dweight = grads
        return (g * dx).astype(dx.dtype), (g * dweight).astype(dweight.dtype), None, None

    fused.defvjp(fused_fwd, fused_bwd)
    return fused(x, weight, targets, mask)


def target_log_probs(
    x: jax.Array,
    weight: jax.Array,
    layout: str,
    targets: jax.Array,
    *,
    rules: Any,
    chunk_rows: int | None = None,
    entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """log_softmax(x · weight)[targets] in fp32 [B, T], read in chunks of about `chunk_rows`
    (default LOSS_CHUNK_ROWS) tokens per device as output_cross_entropy reads them: x [B, T, D]
    (final-normed hidden states), weight [V, D] ("VD") or [D, V] ("DV"), targets int32 [B, T];
    with `entropy`, also each position's entropy of the softmax, −Σ_v p_v log p_v, fp32 [B, T],
    from the same pass over the logits. Not differentiated (a preference loss differentiates
    through output_cross_entropy with each token's weight instead): no [B, T, V] array, no
    gradient program."""
    batch, length, _ = x.shape
    shards = _batch_shards(batch, rules)
    chunk_rows = LOSS_CHUNK_ROWS if chunk_rows is None else chunk_rows
    per_chunk = max(1, chunk_rows // max(1, batch // shards))
    num_chunks = -(-length // per_chunk)
    chunk = -(-length // num_chunks)
    padded = num_chunks * chunk
    gathered_axes = ("vocab", None) if layout == "VD" else (None, "vocab")
    weight = constrain(jax.lax.stop_gradient(weight), gathered_axes, rules)
    x, targets = jax.lax.stop_gradient(x), jnp.pad(targets, ((0, 0), (0, padded - length)))
    x = jnp.pad(x, ((0, 0), (0, padded - length), (0, 0)))

    def chunk_log_probs(inputs: tuple[jax.Array, jax.Array]) -> jax.Array:
        xc, tc = inputs  # [B, c, D], [B, c]
        logits = jnp.einsum(f"BTD,{layout}->BTV", xc, weight)
        logits = constrain(logits, ("batch", "length", "vocab"), rules).astype(jnp.float32)
        top = jnp.max(logits, axis=-1, keepdims=True)
        exp = jnp.exp(logits - top)
        total = jnp.sum(exp, axis=-1)
        lse = top[..., 0] + jnp.log(total)
        log_probs = _target_logits(logits, tc, shards > 1) - lse  # [B, c]
        if not entropy:
            return log_probs
        return log_probs, lse - jnp.sum(exp * logits, axis=-1) / total  # H = lse − E_p[logit]

    xs = jnp.moveaxis(x.reshape(batch, num_chunks, chunk, -1), 1, 0)  # [chunks, B, c, D]
    ts = jnp.moveaxis(targets.reshape(batch, num_chunks, chunk), 1, 0)
    per_chunk = jax.lax.map(chunk_log_probs, (xs, ts))  # [chunks, B, c] (each output)
    return jax.tree.map(
        lambda a: jnp.moveaxis(a, 0, 1).reshape(batch, padded)[:, :length], per_chunk
    )
