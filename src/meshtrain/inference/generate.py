"""Greedy or sampled text generation, for sanity checks of a model: `meshtrain.generate(model,
tokenizer, prompt)`; its command line is meshtrain.cli.generate.

Every new token runs the model over the whole fixed-length buffer (no key/value cache): one
compilation, quadratic cost, fine for the few dozen tokens of a sanity check.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtrain.data.tokenizer import Tokenizer
from meshtrain.models.transformer import Transformer


@partial(nnx.jit, static_argnames=("vocab_size", "greedy"))
def _next_token(model, tokens, position, key, temperature, *, vocab_size, greedy):
    """The token after tokens[0, position - 1]. tokens: int32 [1, total]."""
    logits = model(tokens)[0].astype(jnp.float32)  # [total, V]
    logits = jax.lax.dynamic_index_in_dim(logits, position - 1, keepdims=False)  # [V]
    # Embedding rows past the tokenizer's vocabulary are padding, never a real token.
    logits = jnp.where(jnp.arange(logits.shape[0]) < vocab_size, logits, -jnp.inf)
    if greedy:
        return jnp.argmax(logits)
    return jax.random.categorical(key, logits / temperature)


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
    start, total = len(ids), len(ids) + max_new_tokens
    tokens = np.zeros((1, total), np.int32)  # [1, total]; positions after the current one are
    tokens[0, :start] = ids  # never seen by the causal model, so zeros are as good as anything
    static = dict(vocab_size=tokenizer.vocab_size, greedy=temperature == 0)
    key = jax.random.key(seed)
    end = start
    for position in range(start, total):
        key, step_key = jax.random.split(key)
        token = int(_next_token(model, tokens, position, step_key, temperature, **static))
        if token == tokenizer.eos_id:
            break
        tokens[0, position] = token
        end = position + 1
    return tokenizer.decode(tokens[0, start:end])
