"""The device side of generation: the programs that decode a batch of prompts with the key/value
cache (models.decode), the choice of each next token, and `Decoding`, the same steps a stretch
at a time for a caller that stops rows between stretches (the harness's stop strings).

One compiled program per (batch size, rows a prompt, prompt length bucket, max_new_tokens,
sampling kind): the prompts left-padded to the power of two (at least MIN_BUCKET tokens) of the
longest, so that prompts of similar lengths share it; a prefill that fills the prompts'
key/value cache; then a loop on the device of one-token decode steps that write into a cache of
max_new_tokens positions a row and read both instead of rerunning the sequence, until every row
has picked a stop id or max_new_tokens. A prompt decoded by several rows (`repeats`) is
prefilled and held once. On a sharded model it runs under the parameters' mesh, the rows over
the batch axes and the cache sharded like the layers' keys and values. The functions users call
(text in, text out, and token ids) are meshtrain.inference.generate's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtrain.models import decode
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.rules import constrain

MIN_BUCKET = 16  # the shortest padded prompt: shorter prompts share one prefill program


def prompt_bucket(length: int) -> int:
    """The padded length of a prompt of `length` tokens: the next power of two, at least
    MIN_BUCKET. A new bucket (or max_new_tokens) compiles the generation again; a new length
    within one does not."""
    return max(MIN_BUCKET, 1 << (length - 1).bit_length())


def _pick(
    logits: jax.Array,
    key: jax.Array,
    temperature,
    top_k=0,
    top_p=1.0,
    *,
    vocab_size: int,
    greedy: bool,
    truncate: bool = False,
) -> jax.Array:
    """The next token of each row from logits [B, V] (int32 [B]): the most likely (`greedy`), or
    sampled from softmax(logits / temperature), with `truncate` only among the row's top_k most
    likely tokens (0: all) and, of those, the fewest whose probabilities add up to top_p (1:
    all), in transformers' order (temperature, then top-k, then top-p; ties at either cut kept)."""
    logits = logits.astype(jnp.float32)  # [B, V]
    # Embedding rows past the tokenizer's vocabulary are padding, never a real token.
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if truncate:
        logits = _top_k_top_p(logits, top_k, top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _top_k_top_p(logits: jax.Array, top_k, top_p) -> jax.Array:
    """logits [B, V] with every token outside the top-k / top-p set of its row at -inf."""
    ranked = -jnp.sort(-logits, axis=-1)  # [B, V], most likely first
    vocab = logits.shape[-1]
    kept = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranked = jnp.where(ranked < ranked[:, kept - 1][:, None], -jnp.inf, ranked)  # the top k
    probabilities = jax.nn.softmax(ranked, axis=-1)  # [B, V]
    before = jnp.cumsum(probabilities, axis=-1) - probabilities  # the mass ranked above each
    in_nucleus = (before < top_p) | (top_p >= 1)  # the most likely token always is
    last = jnp.sum(in_nucleus & (ranked > -jnp.inf), axis=-1, keepdims=True)  # [B, 1]
    threshold = jnp.take_along_axis(ranked, jnp.maximum(last - 1, 0), axis=-1)  # [B, 1]
    return jnp.where(logits < threshold, -jnp.inf, logits)


# A decoding: (step, token [B], cache, key, picked [B, max_new_tokens], done [B], prompt): the
# cache of the slots after the prompts, and the prompts' own (models.decode.decode_step).
Carry = tuple


def _begin(model, tokens, pad, stop_ids, seed, pick, max_new_tokens: int, repeats: int = 1):
    """The prefill of the left-padded prompts tokens [N, P] (`pad` [N] padding slots before
    each) into the prompts' cache, a cache for max_new_tokens more slots of each of the
    B = N · repeats rows (each prompt's `repeats` rows together: a prompt decoded several times
    is computed and held once, its rows read it), and the first picked id of each row. Returns
    the carry and the rows' padding [B]."""
    bucket = tokens.shape[1]
    logits, prompt = decode.prefill(model, tokens, bucket, bucket, pad)  # [N, V]
    if repeats > 1:
        logits, pad = jnp.repeat(logits, repeats, axis=0), jnp.repeat(pad, repeats, axis=0)
    batch = logits.shape[0]
    cache = decode.init_cache(model, batch, max_new_tokens)
    key, step_key = jax.random.split(jax.random.key(seed))
    token = constrain(pick(logits, step_key), ("batch",), model.rules)  # [B]
    picked = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(token)
    done = jnp.isin(token, stop_ids)
    return (jnp.int32(1), token, cache, key, picked, done, prompt), pad


def _advance(model, carry: Carry, limit, pad, stop_ids, pick, bucket: int) -> Carry:
    """Decode steps in a loop on the device, from the carry's step until every row has picked
    one of `stop_ids` (or is done) or `limit` ids are picked (at most the picked array's)."""
    limit = jnp.minimum(limit, carry[4].shape[1])

    def more(carry) -> jax.Array:
        step, done = carry[0], carry[5]
        return (step < limit) & ~jnp.all(done)

    def next_token(carry):
        step, token, cache, key, picked, done, prompt = carry
        logits, cache = decode.decode_step(
            model, token[:, None], bucket + step - 1, cache, pad, prompt
        )
        key, step_key = jax.random.split(key)
        token = jnp.where(done, 0, pick(logits, step_key))  # a finished row picks nothing
        token = constrain(token, ("batch",), model.rules)
        picked = jax.lax.dynamic_update_slice_in_dim(picked, token[:, None], step, axis=1)
        return step + 1, token, cache, key, picked, done | jnp.isin(token, stop_ids), prompt

    return jax.lax.while_loop(more, next_token, carry)


def _picker(temperature, top_k, top_p, *, vocab_size: int, greedy: bool, truncate: bool):
    return partial(
        _pick,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        vocab_size=vocab_size,
        greedy=greedy,
        truncate=truncate,
    )


SAMPLING = ("vocab_size", "greedy", "truncate")  # the static arguments of _picker


@partial(nnx.jit, static_argnames=("max_new_tokens", "repeats", *SAMPLING), graph=False)
def generate_batch_program(
    model,
    tokens,
    pad,
    stop_ids,
    seed,
    temperature,
    top_k,
    top_p,
    *,
    max_new_tokens,
    repeats=1,
    **static,
) -> tuple[jax.Array, jax.Array]:
    """Up to max_new_tokens ids after each left-padded prompt of tokens [N, P] (int32; `pad` [N]
    padding slots before each), each prompt decoded `repeats` times (B = N · repeats rows, each
    prompt's together): one prefill, then decode steps in a loop on the device until every row
    has picked one of `stop_ids` [n] or max_new_tokens are picked. Returns the picked ids
    [B, max_new_tokens] (0 after a row's stop id) and the steps run (a scalar)."""
    pick = _picker(temperature, top_k, top_p, **static)
    carry, pad = _begin(model, tokens, pad, stop_ids, seed, pick, max_new_tokens, repeats)
    carry = _advance(model, carry, max_new_tokens, pad, stop_ids, pick, tokens.shape[1])
    steps, picked = carry[0], carry[4]
    return constrain(picked, (), model.rules), steps  # replicated: every process reads them


@partial(nnx.jit, static_argnames=("max_new_tokens", *SAMPLING), graph=False)
def _begin_program(
    model, tokens, pad, stop_ids, seed, temperature, top_k, top_p, *, max_new_tokens, **static
) -> Carry:
    pick = _picker(temperature, top_k, top_p, **static)
    return _begin(model, tokens, pad, stop_ids, seed, pick, max_new_tokens)[0]


@partial(nnx.jit, static_argnames=("bucket", *SAMPLING), donate_argnames=("carry",), graph=False)
def _advance_program(
    model, carry, stopped, limit, pad, stop_ids, temperature, top_k, top_p, *, bucket, **static
) -> tuple[Carry, jax.Array, jax.Array]:
    """_advance after marking the rows `stopped` [B] (by the caller) done; also returns the
    picked ids and the done rows, replicated."""
    pick = _picker(temperature, top_k, top_p, **static)
    step, token, cache, key, picked, done, prompt = carry
    carry = step, token, cache, key, picked, done | stopped, prompt
    carry = _advance(model, carry, limit, pad, stop_ids, pick, bucket)
    return carry, constrain(carry[4], (), model.rules), constrain(carry[5], (), model.rules)


class PaddedPrompts:
    """Prompts left-padded to one bucket, as the generation programs take them."""

    def __init__(self, prompts: Sequence[Sequence[int] | np.ndarray], bucket: int | None):
        rows = [np.asarray(ids, np.int32).reshape(-1) for ids in prompts]
        if any(not ids.size for ids in rows):
            raise ValueError("a prompt has no tokens to start from")
        longest = max(ids.size for ids in rows)
        if bucket is None:
            bucket = prompt_bucket(longest)
        elif bucket < longest:
            raise ValueError(
                f"bucket={bucket} is shorter than the longest prompt ({longest} tokens)"
            )
        self.tokens = np.zeros((len(rows), bucket), np.int32)  # [B, bucket], each at the end
        self.pad = np.array([bucket - ids.size for ids in rows], np.int32)  # [B]
        for row, ids in enumerate(rows):
            self.tokens[row, self.pad[row] :] = ids


def sampling_arguments(model, temperature: float, top_k: int, top_p: float, vocab_size: int | None):
    """The sampling inputs of the programs (as numpy scalars) and their static arguments."""
    inputs = (np.float32(temperature), np.int32(top_k), np.float32(top_p))
    static = dict(
        vocab_size=int(model.embed.shape[0] if vocab_size is None else vocab_size),
        greedy=temperature == 0,
        truncate=temperature > 0 and (top_k > 0 or top_p < 1),
    )
    return inputs, static


def stop_array(stop_ids: Iterable[int]) -> np.ndarray:
    return np.asarray(sorted({int(i) for i in stop_ids}) or [-1], np.int32)  # -1: none stops


def through_stop(picked: np.ndarray, stops: np.ndarray) -> list[np.ndarray]:
    """Each row of picked [B, steps] up to and with its first stop id."""
    out = []
    for row in picked:
        hits = np.flatnonzero(np.isin(row, stops))
        out.append(row[: hits[0] + 1] if hits.size else row)
    return out


class Decoding:
    """A batch of prompts decoded a stretch of steps at a time, for a caller that stops rows on
    what they wrote between stretches (the harness's stop strings, checked on the text): the
    same prefill and decode steps as generate_ids_batch (its arguments), in two programs, one
    prefill and one stretch of decode steps, whatever the stretch's length. Run it under the
    parameters' mesh (`put`: as generate_ids_batch's)."""

    def __init__(
        self,
        model: Transformer,
        prompts: Sequence[Sequence[int] | np.ndarray],
        max_new_tokens: int,
        temperature: float = 0.0,
        *,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        seed: int = 0,
        put: Callable[[np.ndarray | np.generic], Any] = lambda array: array,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        padded = PaddedPrompts(prompts, None)
        self.model, self.put = model, put
        self.rows, self.bucket = padded.tokens.shape
        inputs, self.static = sampling_arguments(model, temperature, top_k, top_p, vocab_size)
        self.inputs = (put(padded.pad), put(stop_array(stop_ids)), *map(put, inputs))
        self.carry = _begin_program(
            model,
            put(padded.tokens),
            *self.inputs[:2],
            put(np.int32(seed)),
            *self.inputs[2:],
            max_new_tokens=max_new_tokens,
            **self.static,
        )
        self.steps = 1
        self.max_new_tokens = max_new_tokens
        self.done = np.zeros(self.rows, bool)  # [B]: rows that picked a stop id or were stopped

    @property
    def finished(self) -> bool:
        """Whether no row decodes further: each is done, or max_new_tokens are picked."""
        return bool(self.done.all()) or self.steps >= self.max_new_tokens

    def advance(self, steps: int, stopped: np.ndarray | None = None) -> np.ndarray:
        """Marks the rows `stopped` (bool [B]) done, decodes up to `steps` more ids for the
        others, and returns every id picked so far, int32 [B, steps so far] (0 after a row is
        done)."""
        stopped = np.zeros(self.rows, bool) if stopped is None else np.asarray(stopped, bool)
        limit = min(self.steps + steps, self.max_new_tokens)
        self.carry, picked, done = _advance_program(
            self.model,
            self.carry,
            self.put(stopped),
            self.put(np.int32(limit)),
            *self.inputs,
            bucket=self.bucket,
            **self.static,
        )
        self.done = np.asarray(done) | stopped
        self.steps = int(self.carry[0])
        return np.asarray(picked)[:, : self.steps]


def generation_program(
    model: Transformer,
    prompts: int,
    bucket: int,
    max_new_tokens: int,
    *,
    vocab_size: int,
    repeats: int = 1,
    top_k: int = 0,
    top_p: float = 1.0,
) -> jax.stages.Lowered:
    """generate_ids_batch's sampling program for `prompts` prompts padded to `bucket`, each
    decoded `repeats` times, lowered on abstract inputs (the model's parameters may be
    ShapeDtypeStructs): what a dry run compiles for a policy-gradient run's rollouts. Run it
    under the parameters' mesh."""
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)  # noqa: E731
    lowered = generate_batch_program.lower(
        model,
        jax.ShapeDtypeStruct((prompts, bucket), jnp.int32),
        jax.ShapeDtypeStruct((prompts,), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),  # eos and an end of turn
        scalar(jnp.int32),
        scalar(jnp.float32),
        scalar(jnp.int32),
        scalar(jnp.float32),
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        vocab_size=vocab_size,
        greedy=False,
        truncate=top_k > 0 or top_p < 1,
    )
    return lowered.lowered  # nnx's wrapper's jax program
