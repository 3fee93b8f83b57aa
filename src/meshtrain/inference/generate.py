"""Greedy or sampled generation: `meshtrain.generate(model, tokenizer, prompt)` continues a text
up to eos and `complete_texts` a batch of them; `generate_chat(model, encoder, messages)`
answers a conversation rendered with a chat template (meshtrain.data.chat.encoder) up to its
end-of-turn token or eos, and `answer_chats` a batch of them; all run `generate_ids_batch`, the
decoding of token ids with a set of ids to stop at. Their command line is meshtrain.cli.generate.

The batch decodes on the device with the key/value cache, one compiled program per (batch
size, prompt length bucket, max_new_tokens, sampling kind): meshtrain.inference.decoding. On a
sharded model (`meshtrain.load_hf(path, mesh)`, `load_checkpoint`) it runs under the parameters'
mesh, the rows over the batch axes. Tokens/s: docs/models.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from meshtrain.data.tokenizer import Tokenizer
from meshtrain.inference.decoding import (
    PaddedPrompts,
    generate_batch_program,
    sampling_arguments,
    stop_array,
    through_stop,
)
from meshtrain.models.transformer import Transformer

if TYPE_CHECKING:
    from meshtrain.data.chat.encoder import ChatEncoder


def generate_ids_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int] | np.ndarray],
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_ids: Iterable[int] = (),
    vocab_size: int | None = None,
    seed: int = 0,
    bucket: int | None = None,
    repeats: int = 1,
    put: Callable[[np.ndarray | np.generic], Any] = lambda array: array,
) -> list[np.ndarray]:
    """The ids the model picks after each of `prompts`, decoded together as one batch (rows
    sharded over the batch axes of the parameters' mesh): int32 [at most max_new_tokens] each,
    ending with the first of `stop_ids` picked, which is kept (as transformers' generate keeps
    its eos). temperature 0 picks the most likely token; above 0 samples from
    softmax(logits / temperature), among the top_k most likely (0: all) and the fewest of
    those whose probabilities reach top_p (1: all). Ids from `vocab_size` on (default: the
    model's embedding rows) are never picked. One program per (batch size, prompt bucket,
    max_new_tokens, sampling kind): the prompts are left-padded to the bucket of the longest, or
    to `bucket` (at least the longest prompt), which a caller that knows all its prompts' lengths
    fixes once (a policy-gradient run's rollouts: one program for the run). With `repeats` each
    prompt is decoded that many times (its rows together, each sampled on its own), its prefill
    computed once. `put` makes each
    input an array on the parameters' mesh (global arrays, where the mesh spans processes that
    all make this call with the same prompts); every process gets every row's ids."""
    if not prompts:
        return []
    padded = PaddedPrompts(prompts, bucket)
    if max_new_tokens < 1:
        return [np.zeros(0, np.int32) for _ in range(len(prompts) * repeats)]
    stops = stop_array(stop_ids)
    inputs, static = sampling_arguments(model, temperature, top_k, top_p, vocab_size)
    with model.on_params_mesh():
        picked, steps = generate_batch_program(
            model,
            put(padded.tokens),
            put(padded.pad),
            put(stops),
            put(np.int32(seed)),
            *map(put, inputs),
            max_new_tokens=max_new_tokens,
            repeats=repeats,
            **static,
        )
    return through_stop(np.asarray(picked)[:, : int(steps)], stops)


def generate_ids(
    model: Transformer, prompt_ids: Sequence[int] | np.ndarray, *args: Any, **kwargs: Any
) -> np.ndarray:
    """The ids the model picks after one prompt: generate_ids_batch of a batch of one."""
    return generate_ids_batch(model, [prompt_ids], *args, **kwargs)[0]


def _until(ids: np.ndarray, stop_ids: Iterable[int]) -> np.ndarray:
    """`ids` without the stop id generate_ids ends them with, if it does."""
    return ids[:-1] if ids.size and int(ids[-1]) in set(stop_ids) else ids


def complete_texts(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    **sampling: Any,
) -> list[str]:
    """The text the model continues each prompt with, all decoded as one batch: up to
    max_new_tokens tokens, stopping at eos. `sampling`: generate_ids_batch's top_k, top_p and
    seed."""
    rows = []
    for prompt in prompts:
        ids = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
        rows.append(ids + tokenizer.encode(prompt).tolist())
        if not rows[-1]:
            raise ValueError("the prompt is empty and the tokenizer has no bos token to start from")
    stop_ids = (tokenizer.eos_id,)
    new = generate_ids_batch(
        model,
        rows,
        max_new_tokens,
        temperature,
        stop_ids=stop_ids,
        vocab_size=tokenizer.vocab_size,
        **sampling,
    )
    return [tokenizer.decode(_until(ids, stop_ids)) for ids in new]


def generate(
    model: Transformer, tokenizer: Tokenizer, prompt: str, *args: Any, **kwargs: Any
) -> str:
    """The text the model continues `prompt` with: complete_texts of one prompt. temperature 0
    picks the most likely token; above 0 samples from softmax(logits / temperature)."""
    return complete_texts(model, tokenizer, [prompt], *args, **kwargs)[0]


def answer_chats(
    model: Transformer,
    encoder: ChatEncoder,
    conversations: Sequence[Sequence[dict]],
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    **sampling: Any,
) -> list[str]:
    """The assistant's answer to each conversation ({role, content} messages), all decoded as
    one batch: each rendered with the encoder's chat template and its generation prompt
    (ChatEncoder.render_generation_prompt), continued up to max_new_tokens tokens or the
    template's end-of-turn token or eos, decoded without it. `sampling` as complete_texts'."""
    prompts = [encoder.render_generation_prompt(messages) for messages in conversations]
    stop_ids = {i for prompt in prompts for i in prompt.stop_ids}  # the same for every prompt
    new = generate_ids_batch(
        model,
        [prompt.ids for prompt in prompts],
        max_new_tokens,
        temperature,
        stop_ids=stop_ids,
        vocab_size=encoder.tokenizer.vocab_size,
        **sampling,
    )
    return [encoder.tokenizer.decode(_until(ids, stop_ids)) for ids in new]


def generate_chat(
    model: Transformer, encoder: ChatEncoder, messages: Sequence[dict], *args: Any, **kwargs: Any
) -> str:
    """The assistant's answer to `messages`: answer_chats of one conversation."""
    return answer_chats(model, encoder, [messages], *args, **kwargs)[0]
