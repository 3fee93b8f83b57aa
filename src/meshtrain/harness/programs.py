"""The harness's three compiled programs: `score` (the log-probability of each target token of a
packed batch, and whether it is the model's most likely one), and `prefill` and `decode` (greedy
or sampled generation with the key/value cache of models.decode).

Each takes the model as a pytree (nnx.jit, graph=False, as inference.generate): its arrays are
the model's own (no copy), so a training run evaluates its current parameters in place, and a
model rebuilt around other arrays of the same shapes reuses the compiled programs.
They run under the parameters' mesh (`jax.set_mesh`, by the caller), their inputs are global
arrays (`on_mesh`) and every output is replicated, so each process of a multi-process run holds
the whole result. TRACES counts the programs traced (one per compile), for the tests.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshtrain.models import decode
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.rules import constrain, logical_to_spec

TRACES: Counter[str] = Counter()  # program name → times traced (each is a compile)
LOGITS_BUDGET = 1 << 26  # the most fp32 logits `score` holds at once (256 MiB)


def on_mesh(mesh: Mesh | None, array: np.ndarray, logical_axes: tuple, rules: Any) -> jax.Array:
    """`array`, the same on every process, as a global array on `mesh` laid out by its logical
    axes (each device reads its own slice), or as a local array without a mesh."""
    if mesh is None:
        return jnp.asarray(array)
    sharding = NamedSharding(mesh, logical_to_spec(logical_axes, rules))
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def score_chunk(rows: int, vocab: int, length: int) -> int:
    """How many positions of a [rows, length] batch `score` turns into logits [rows, vocab] at
    a time: within LOGITS_BUDGET, at least 1."""
    return max(1, min(length, LOGITS_BUDGET // (rows * vocab)))


@partial(nnx.jit, static_argnames=("chunk",), graph=False)
def score(
    model: Transformer,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    targets: jax.Array,
    *,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """For a packed batch (int32 [R, L] each: harness.packing.PackedBatch), the log-probability
    of each target token under the model, float32 [R, L], and whether it is the argmax of the
    logits, bool [R, L]. The logits [R, V] of `chunk` positions at a time are computed from the
    hidden states and reduced at once (a batch's [R, L, V] logits can be gigabytes)."""
    TRACES["score"] += 1
    hidden = model.hidden(tokens, positions, segment_ids)  # [R, L, D]
    weight, layout = model.output_weight()  # [V, D] or [D, V]

    def position(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        h, target = args  # [R, D], [R]
        logits = jnp.einsum(f"RD,{layout}->RV", h, weight).astype(jnp.float32)  # [R, V]
        picked = jnp.take_along_axis(logits, target[:, None], axis=-1)[:, 0]  # [R]
        logprob = picked - jax.nn.logsumexp(logits, axis=-1)
        return logprob, jnp.argmax(logits, axis=-1) == target

    per_position = (jnp.swapaxes(hidden, 0, 1), targets.T)  # [L, R, D], [L, R]
    logprob, greedy = jax.lax.map(position, per_position, batch_size=chunk)  # [L, R] each
    replicated = lambda x: constrain(x.T, (None, None), model.rules)  # noqa: E731
    return replicated(logprob), replicated(greedy)


def _pick(logits: jax.Array, key: jax.Array, temperature: jax.Array, *, vocab_size: int, greedy):
    """The next token from logits [1, V], int32 []: the most likely, or sampled at
    `temperature`; ids from `vocab_size` on (embedding rows past the tokenizer's) never."""
    logits = logits[0].astype(jnp.float32)  # [V]
    logits = jnp.where(jnp.arange(logits.shape[0]) < vocab_size, logits, -jnp.inf)
    if greedy:
        return jnp.argmax(logits).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


@partial(nnx.jit, static_argnames=("cache_length", "vocab_size", "greedy"), graph=False)
def prefill(
    model: Transformer,
    tokens: jax.Array,
    length: jax.Array,
    seed: jax.Array,
    temperature: jax.Array,
    *,
    cache_length: int,
    vocab_size: int,
    greedy: bool,
) -> tuple[jax.Array, decode.KVCache, jax.Array]:
    """The token after tokens[0, :length] (int32 [1, bucket], padded after the prompt), the
    cache of `cache_length` positions holding the prompt's keys and values, the next key."""
    TRACES["prefill"] += 1
    logits, cache = decode.prefill(model, tokens, length, cache_length)  # [1, V]
    key, step_key = jax.random.split(jax.random.key(seed))
    token = _pick(logits, step_key, temperature, vocab_size=vocab_size, greedy=greedy)
    return constrain(token, (), model.rules), cache, key


@partial(
    nnx.jit,
    static_argnames=("vocab_size", "greedy"),
    donate_argnames=("cache",),
    graph=False,
)
def decode_step(
    model: Transformer,
    token: jax.Array,
    position: jax.Array,
    cache: decode.KVCache,
    key: jax.Array,
    temperature: jax.Array,
    *,
    vocab_size: int,
    greedy: bool,
) -> tuple[jax.Array, decode.KVCache, jax.Array]:
    """The token after `token` (int32 []) at `position`, the cache with its keys and values
    added, the next key."""
    TRACES["decode"] += 1
    logits, cache = decode.decode_step(model, token.reshape(1, 1), position, cache)  # [1, V]
    key, step_key = jax.random.split(key)
    token = _pick(logits, step_key, temperature, vocab_size=vocab_size, greedy=greedy)
    return constrain(token, (), model.rules), cache, key
