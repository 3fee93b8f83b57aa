"""The transformer with a key/value cache, for generation: `prefill` runs the prompt once and
keeps every layer's keys and values, then `decode_step` runs one new token against them.

Without a cache every new token reruns the whole sequence (quadratic in its length); with it,
a token costs one pass of the weights plus one read of the cache. Both use the model's own
parameters and layers (models.transformer, models.layers), so they serve every family: QK-norm,
local layers with their window and RoPE base, sandwich norms, embedding scaling, grouped-query
attention down to one key/value head, `scan_layers` and key/value heads replicated over tp.

The cache holds, per layer, the rotated keys [B, K, S, H] and the values [B, K, H, S] of every
position so far (`KVCache`), S = the positions it has room for, sharded like the keys and values
of the layers (K over tp, or replicated where models.abstract.fit_kv_heads replicates them). The
heads come before the positions, and each array keeps innermost the axis a decode step's
attention product contracts (the keys' features against the query, the values' positions
against the probabilities), so that both products read a layer's cache as it lies, with no
transposed copy of the whole cache per step; each step writes its token's keys and values into
the cache in place. Positions past the current one hold zeros or the keys of prompt padding; the
causal mask keeps any query from reading them, and the next token overwrites them.

Generation keeps the prompts' keys and values apart from the new tokens': a prefill fills a
cache of the prompts' slots, and the decode steps write into a cache of the slots after them
(decode_step's `prompt`). A prompt decoded several times (a GRPO group of rows) is then
prefilled and held once, and each decode step reads its keys once for all its rows (one
product of the group's queries), not once per row.

A batch of prompts of different lengths is left-padded (`pad` [B]: the padding slots before
each row's prompt), so that every row's next token goes to the same cache slot: a row's RoPE
position is its slot minus its padding, and no query reads a padding slot (a segment mask in
the prefill, a key mask in the decode steps).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.models.attention import AttentionKernel, attention_mask, dot_product_attention
from meshtrain.models.block import Block
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.rules import constrain

KEY_AXES = ("layers", "batch", "kv_heads", "length", None)  # logical axes of the cache's keys
VALUE_AXES = ("layers", "batch", "kv_heads", None, "length")  # and of its values


Layers = jax.Array | tuple[jax.Array, ...]  # stacked [layers, ...], or one array a layer


class KVCache(NamedTuple):
    """Every layer's rotated keys [B, K, S, H] and values [B, K, H, S]: stacked, [layers, ...],
    for scanned layers (the scan reads a layer at a time), else a tuple of the layers' arrays,
    each read where it lies (not copied out of a stack)."""

    keys: Layers
    values: Layers

    def constrained(self, rules: Any) -> KVCache:
        """The cache with its arrays' shardings pinned (the layers' keys and values')."""

        def pin(part: Layers, axes: tuple) -> Layers:
            if isinstance(part, tuple):
                return tuple(constrain(layer, axes[1:], rules) for layer in part)
            return constrain(part, axes, rules)

        return KVCache(pin(self.keys, KEY_AXES), pin(self.values, VALUE_AXES))


def init_cache(model: Transformer, batch: int, length: int) -> KVCache:
    """A cache of zeros with room for `length` positions, in the compute dtype of the model."""
    attn = model.blocks.attn if model.scan_layers else model.blocks[0].attn
    shape = (batch, attn.num_kv_heads, length, attn.head_dim)
    dtype, layers = model.embed[...].dtype, len(model.layer_kinds)
    keys, values = (jnp.zeros(shape, dtype), jnp.zeros((*shape[:2], *shape[:1:-1]), dtype))
    if model.scan_layers:
        cache = KVCache(*(jnp.broadcast_to(part, (layers, *part.shape)) for part in (keys, values)))
    else:
        cache = KVCache((keys,) * layers, (values,) * layers)
    return cache.constrained(model.rules)


def prefill(
    model: Transformer,
    tokens: jax.Array,
    length: jax.Array,
    cache_length: int,
    pad: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Runs tokens [B, P] (slots 0 … length - 1 hold the prompts, each after its `pad` [B]
    padding slots, default none; slots from `length` on are padding too) with the training
    path's attention kernel, and keeps their keys and values in a new cache of `cache_length`
    ≥ P slots. Returns the logits [B, V] after slot length - 1 (those of the padding after it
    are never computed) and the cache."""
    batch, prompt = tokens.shape
    cache = init_cache(model, batch, cache_length)
    positions = slots = jnp.broadcast_to(jnp.arange(prompt), tokens.shape)  # [B, P]
    segments = None
    if pad is not None:
        segments = (slots >= pad[:, None]).astype(jnp.int32)  # [B, P]: 0 padding, 1 prompt
        positions = jnp.maximum(slots - pad[:, None], 0)
    x, cache = _run(
        model, tokens, positions, cache, start=0, prefill=True, segments=segments
    )  # [B, P, D]
    last = jax.lax.dynamic_slice_in_dim(x, length - 1, 1, axis=1)  # [B, 1, D]
    return model.logits(model.final_norm(last))[:, 0], cache


def decode_step(
    model: Transformer,
    tokens: jax.Array,
    position: jax.Array,
    cache: KVCache,
    pad: jax.Array | None = None,
    prompt: KVCache | None = None,
) -> tuple[jax.Array, KVCache]:
    """Runs tokens [B, 1] at slot `position` (every earlier slot is in the cache; a row's RoPE
    position is the slot minus its `pad` [B] padding slots, default none): returns the logits
    [B, V] of the next token and the cache with this token's keys and values added.

    With `prompt` (a prefill's cache of the prompts' S_p slots, N prompts, each read by B / N
    consecutive rows: a prompt decoded several times), `cache` holds the slots from S_p on: the
    token goes to its slot position − S_p, and each row's queries read its prompt's keys, shared
    by its group, and its own."""
    positions = jnp.full(tokens.shape, position, jnp.int32)  # [B, 1]
    if pad is not None:
        positions = positions - pad[:, None]
    x, cache = _run(
        model, tokens, positions, cache, start=position, prefill=False, key_pad=pad, prompt=prompt
    )
    return model.logits(model.final_norm(x))[:, 0], cache


def _run(
    model: Transformer,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    *,
    start: jax.Array | int,
    prefill: bool,
    segments: jax.Array | None = None,
    key_pad: jax.Array | None = None,
    prompt: KVCache | None = None,
) -> tuple[jax.Array, KVCache]:
    """The blocks over tokens [B, T] at RoPE `positions` [B, T] and slots start … start + T - 1,
    each layer writing its keys and values into the cache there: a prefill from slot 0
    (`segments` [B, T]: optional segment ids of the tokens) or a decode step (`key_pad` [B]:
    optional padding slots each row's queries never read; `prompt`: decode_step's). Returns the
    residual stream [B, T, D] before the final norm, and the cache."""
    x = model.embed_tokens(tokens)  # [B, T, D]
    per_kind = model.rope_per_kind(positions)
    kernel, _ = model.attention_kernel(x.dtype)

    def layer(block: Block, kind: int, x, keys, values, shared=None):
        sin, cos, window = per_kind[kind]
        return _cached_block(
            block,
            x,
            sin,
            cos,
            keys,
            values,
            start,
            window=window,
            kernel=kernel,
            prefill=prefill,
            segments=segments,
            key_pad=key_pad,
            prompt=shared,
        )

    if not model.scan_layers:
        keys, values = list(cache.keys), list(cache.values)
        for i, (block, kind) in enumerate(zip(model.blocks, model.kind_index, strict=True)):
            shared = None if prompt is None else (prompt.keys[i], prompt.values[i])
            x, keys[i], values[i] = layer(block, kind, x, keys[i], values[i], shared)
        keys, values = tuple(keys), tuple(values)
    else:
        graphdef, stacked = nnx.split(model.blocks)

        def scanned(x, xs):
            params, kind, keys, values, *shared = xs
            shared = tuple(shared) or None  # this layer's prompt keys and values, if any
            branches = [
                lambda x, keys, values, k=k: layer(
                    nnx.merge(graphdef, params), k, x, keys, values, shared
                )
                for k in range(len(per_kind))
            ]
            # Each kind's window is static inside its branch (the training kernels slice by it).
            if len(branches) == 1:
                x, keys, values = branches[0](x, keys, values)
            else:
                x, keys, values = jax.lax.switch(kind, branches, x, keys, values)
            return x, (keys, values)

        kinds = jnp.asarray(model.kind_index, jnp.int32)  # [L]
        xs = (stacked, kinds, *cache, *(() if prompt is None else prompt))
        x, (keys, values) = jax.lax.scan(scanned, x, xs)
    return x, KVCache(keys, values).constrained(model.rules)


def _cached_block(
    block: Block,
    x: jax.Array,
    sin: jax.Array,
    cos: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    start: jax.Array | int,
    *,
    window: int | None,
    kernel: AttentionKernel,
    prefill: bool,
    segments: jax.Array | None,
    key_pad: jax.Array | None,
    prompt: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Block over x [B, T, D] at slots start … start + T - 1, its attention reading the
    layer's cache keys [B, K, S, H] and values [B, K, H, S] once this step's are written into
    them (in place).

    prefill (start 0): the queries see only the new keys (of their own segment), through the
    training path's kernel, so the prompt's logits are those of the model's own call. Decode:
    the queries see the whole cache, masked to the slots at or before them (and within the
    window), none of their row's first key_pad slots; with `prompt` (the layer's prompt keys
    [N, K, S_p, H] and values [N, K, H, S_p], decode_step's), the cache holds the slots from
    S_p on."""
    attn, rules = block.attn, block.rules
    q, k, v = attn.queries_keys_values(block.attn_norm(x), sin, cos)  # [B, T, N|K, H]
    offset = 0 if prompt is None else prompt[0].shape[2]  # the slot of the cache's position 0

    def write(cache: jax.Array, new: jax.Array, order: tuple[int, ...], axes) -> jax.Array:
        new = jnp.transpose(new, order).astype(cache.dtype)  # [B, K, T, H] or [B, K, H, T]
        at = (0, 0, *(start - offset if i == 1 else 0 for i in order[2:]))
        return constrain(jax.lax.dynamic_update_slice(cache, new, at), axes[1:], rules)

    keys = write(keys, k, (0, 2, 1, 3), KEY_AXES)
    values = write(values, v, (0, 2, 3, 1), VALUE_AXES)
    if prefill:
        out = dot_product_attention(
            q,
            *attn.expand_kv(k, v),
            kernel=kernel,
            scale=attn.scale,
            window=window,
            segment_ids=segments,
        )  # [B, T, N, H]
    else:
        query_positions = start + jnp.arange(q.shape[1])  # [T]

        def mask(slots: jax.Array) -> jax.Array:  # [B or 1, 1, T, S] of the key slots [S]
            allowed = attention_mask(query_positions, slots, window=window)
            if key_pad is None:
                return allowed
            return allowed & (slots >= key_pad[:, None])[:, None, None, :]

        own = (keys, values, mask(offset + jnp.arange(keys.shape[2])))
        shared = None if prompt is None else (*prompt, mask(jnp.arange(offset)))
        out = _cached_attention(attn, q, own, shared)
    x, _ = block.after_attention(x, attn.output(out))  # routing statistics: not for decoding
    return x, keys, values


def _cached_attention(
    attn: Any,
    q: jax.Array,
    own: tuple[jax.Array, jax.Array, jax.Array],
    shared: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Queries q [B, T, N, H] against a layer's cache keys [B, K, S, H] and values [B, K, H, S]
    under a mask bool [B or 1, 1, T, S] (`own`), and, with `shared`, against the prompt keys
    [P, K, S_p, H] and values [P, K, H, S_p] each group of B / P consecutive rows reads, under
    a mask [B or 1, 1, T, S_p]: one softmax over both. K key/value heads, each read by
    G = N / K query heads (with the key/value heads replicated over tp, models.layers
    .expand_kv's N). Returns [B, T, N, H]. The scores and the softmax in fp32, as the training
    path's kernels compute them."""
    keys, values, mask = own
    keys, values = _expanded(attn, keys, values)
    batch, length, heads, dim = q.shape
    kv_heads = keys.shape[1]
    q = q.reshape(batch, length, kv_heads, heads // kv_heads, dim)  # [B, T, K, G, H]
    scores = jnp.einsum("btkgh,bksh->bkgts", q, keys, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, :, None], scores * attn.scale, -jnp.inf)  # [B, K, G, T, S]
    if shared is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
        out = jnp.einsum("bkgts,bkhs->btkgh", probs, values)  # [B, T, K, G, H]
        return out.reshape(batch, length, heads, dim)
    prompt_keys, prompt_values, prompt_mask = shared
    prompt_keys, prompt_values = _expanded(attn, prompt_keys, prompt_values)
    prompts, slots = prompt_keys.shape[0], prompt_keys.shape[2]
    grouped = q.reshape(prompts, batch // prompts, *q.shape[1:])  # [P, R, T, K, G, H]
    on_prompt = jnp.einsum(
        "prtkgh,pksh->prkgts", grouped, prompt_keys, preferred_element_type=jnp.float32
    ).reshape(batch, *scores.shape[1:-1], slots)  # [B, K, G, T, S_p]
    on_prompt = jnp.where(prompt_mask[:, :, None], on_prompt * attn.scale, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([on_prompt, scores], axis=-1), axis=-1)
    probs = probs.astype(values.dtype)
    out = jnp.einsum("bkgts,bkhs->btkgh", probs[..., slots:], values)  # [B, T, K, G, H]
    grouped = probs[..., :slots].reshape(prompts, batch // prompts, *probs.shape[1:-1], slots)
    out = out + jnp.einsum("prkgts,pkhs->prtkgh", grouped, prompt_values).reshape(out.shape)
    return out.reshape(batch, length, heads, dim)


def _expanded(attn: Any, keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cache keys [B, K, S, H] and values [B, K, H, S] as the queries read them (expand_kv)."""
    keys, values = attn.expand_kv(jnp.swapaxes(keys, 1, 2), jnp.moveaxis(values, 3, 1))
    return jnp.swapaxes(keys, 1, 2), jnp.moveaxis(values, 1, 3)
