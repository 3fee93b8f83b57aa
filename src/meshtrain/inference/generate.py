"""Greedy or sampled generation: `meshtrain.generate(model, tokenizer, prompt)` continues a text
up to eos; `generate_chat(model, encoder, messages)` answers a conversation rendered with a chat
template (meshtrain.data.chat) up to its end-of-turn token or eos; both run `generate_ids`, the
decoding loop on token ids with a set of ids to stop at, over `picked_ids` (the harness's
generation runs it too). Their command line is meshtrain.cli.generate.

Two compiled programs per (prompt length bucket, max_new_tokens): a prefill that runs the
prompt, padded to a power of two (at least MIN_BUCKET tokens) so that prompts of similar
lengths share it, and fills a key/value cache with room for the bucket plus max_new_tokens
positions (models.decode); and a one-token decode step, reused for every further token, that
reads the cache instead of rerunning the sequence. Each returns the picked token and the next
random key, so nothing else compiles. On a sharded model (`meshtrain.load_hf(path, mesh)`,
`load_checkpoint`) both run under the parameters' mesh, and the cache is sharded like the
layers' keys and values. Tokens/s before and after the cache: docs/models.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtrain.data.tokenizer import Tokenizer
from meshtrain.models import decode
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.rules import constrain

if TYPE_CHECKING:
    from meshtrain.data.chat import ChatEncoder

MIN_BUCKET = 16  # the shortest padded prompt: shorter prompts share one prefill program


def prompt_bucket(length: int) -> int:
    """The padded length of a prompt of `length` tokens: the next power of two, at least
    MIN_BUCKET. A new bucket (or max_new_tokens) compiles two programs; a new length within
    one does not."""
    return max(MIN_BUCKET, 1 << (length - 1).bit_length())


def _pick(logits: jax.Array, key: jax.Array, temperature, *, vocab_size: int, greedy: bool):
    """The next token from logits [1, V]: the most likely, or sampled at `temperature`."""
    logits = logits[0].astype(jnp.float32)  # [V]
    # Embedding rows past the tokenizer's vocabulary are padding, never a real token.
    logits = jnp.where(jnp.arange(logits.shape[0]) < vocab_size, logits, -jnp.inf)
    if greedy:
        return jnp.argmax(logits).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


@partial(nnx.jit, static_argnames=("cache_length", "vocab_size", "greedy"), graph=False)
def _prefill(model, tokens, length, seed, temperature, *, cache_length, vocab_size, greedy):
    """The first new token after tokens[0, :length] (int32 [1, bucket]), the cache, the key."""
    logits, cache = decode.prefill(model, tokens, length, cache_length)  # [1, V]
    key, step_key = jax.random.split(jax.random.key(seed))
    token = _pick(logits, step_key, temperature, vocab_size=vocab_size, greedy=greedy)
    return constrain(token, (), model.rules), cache, key  # replicated: every process reads it


@partial(nnx.jit, static_argnames=("vocab_size", "greedy"), donate_argnames=("cache",), graph=False)
def _decode(model, token, position, cache, key, temperature, *, vocab_size, greedy):
    """The token after `token` (int32 scalar) at `position`, the updated cache, the next key."""
    logits, cache = decode.decode_step(model, token.reshape(1, 1), position, cache)  # [1, V]
    key, step_key = jax.random.split(key)
    token = _pick(logits, step_key, temperature, vocab_size=vocab_size, greedy=greedy)
    return constrain(token, (), model.rules), cache, key


def picked_ids(
    model: Transformer,
    ids: np.ndarray,
    *,
    bucket: int,
    cache_length: int,
    temperature: float,
    vocab_size: int,
    seed: int,
    put: Callable[[np.ndarray | np.generic], Any] = lambda array: array,
) -> Iterator[int]:
    """The ids the model picks after the prompt `ids` (int32 [n], n <= bucket), one at a time,
    for as long as the caller iterates: the prompt padded to `bucket` and run once (the cache
    holds `cache_length` positions), then one decode step per further id. Run it under the
    parameters' mesh; `put` makes each input an array on it (the harness's global arrays)."""
    tokens = np.zeros((1, bucket), np.int32)  # [1, bucket]: the padding after the prompt is
    tokens[0, : ids.size] = ids  # never seen by its causal queries
    static = dict(vocab_size=int(vocab_size), greedy=temperature == 0)
    temperature = put(np.float32(temperature))
    token, cache, key = _prefill(
        model,
        put(tokens),
        put(np.int32(ids.size)),
        put(np.int32(seed)),
        temperature,
        cache_length=cache_length,
        **static,
    )
    position = ids.size  # where `token` goes in the sequence
    while True:
        yield int(token)
        token, cache, key = _decode(
            model, token, put(np.int32(position)), cache, key, temperature, **static
        )
        position += 1


def generate_ids(
    model: Transformer,
    prompt_ids: Sequence[int] | np.ndarray,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    *,
    stop_ids: Iterable[int] = (),
    vocab_size: int | None = None,
    seed: int = 0,
) -> np.ndarray:
    """The ids the model picks after `prompt_ids`, int32 [at most max_new_tokens]: they end with
    the first of `stop_ids` picked, which is kept (as transformers' generate keeps its eos).
    temperature 0 picks the most likely token; above 0 samples from softmax(logits / temperature).
    Ids from `vocab_size` on (default: the model's embedding rows) are never picked."""
    ids = np.asarray(prompt_ids, np.int32).reshape(-1)
    if not ids.size:
        raise ValueError("the prompt has no tokens to start from")
    if max_new_tokens < 1:
        return np.zeros(0, np.int32)
    stops = {int(i) for i in stop_ids}
    bucket = prompt_bucket(ids.size)
    new: list[int] = []
    with model.on_params_mesh():
        for picked in picked_ids(
            model,
            ids,
            bucket=bucket,
            cache_length=bucket + max_new_tokens,
            temperature=temperature,
            vocab_size=model.embed.shape[0] if vocab_size is None else vocab_size,
            seed=seed,
        ):
            new.append(picked)
            if picked in stops or len(new) == max_new_tokens:
                break
    return np.asarray(new, np.int32)


def _until(ids: np.ndarray, stop_ids: Iterable[int]) -> np.ndarray:
    """`ids` without the stop id generate_ids ends them with, if it does."""
    return ids[:-1] if ids.size and int(ids[-1]) in set(stop_ids) else ids


def generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    *,
    seed: int = 0,
) -> str:
    """The text the model continues `prompt` with: up to max_new_tokens tokens, stopping at eos.
    temperature 0 picks the most likely token; above 0 samples from softmax(logits / temperature)."""
    ids = ([tokenizer.bos_id] if tokenizer.bos_id >= 0 else []) + tokenizer.encode(prompt).tolist()
    if not ids:
        raise ValueError("the prompt is empty and the tokenizer has no bos token to start from")
    stop_ids = (tokenizer.eos_id,)
    new = generate_ids(
        model,
        ids,
        max_new_tokens,
        temperature,
        stop_ids=stop_ids,
        vocab_size=tokenizer.vocab_size,
        seed=seed,
    )
    return tokenizer.decode(_until(new, stop_ids))


def generate_chat(
    model: Transformer,
    encoder: ChatEncoder,
    messages: Sequence[dict],
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    *,
    seed: int = 0,
) -> str:
    """The assistant's answer to `messages` ({role, content}): the conversation rendered with the
    encoder's chat template and its generation prompt (ChatEncoder.render_generation_prompt),
    continued up to max_new_tokens tokens or the template's end-of-turn token or eos, decoded
    without it. temperature as generate's."""
    prompt = encoder.render_generation_prompt(messages)
    new = generate_ids(
        model,
        prompt.ids,
        max_new_tokens,
        temperature,
        stop_ids=prompt.stop_ids,
        vocab_size=encoder.tokenizer.vocab_size,
        seed=seed,
    )
    return encoder.tokenizer.decode(_until(new, prompt.stop_ids))
