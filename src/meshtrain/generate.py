"""Greedy or sampled text generation, for sanity checks of a model; and its command line:

    python -m meshtrain.generate <checkpoint> "prompt" [--max-new-tokens 32]

<checkpoint> is a meshtrain checkpoint (a step directory, its checkpoints/ directory, a run
directory or an orbax export; the tokenizer is the one it was trained with) or a Hugging Face
checkpoint directory (config.json, *.safetensors and the tokenizer).

Every new token runs the model over the whole fixed-length buffer (no key/value cache): one
compilation, quadratic cost, fine for the few dozen tokens of a sanity check.
This module is also callable, so that `meshtrain.generate(model, tokenizer, prompt)` works.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import types
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtrain.data.tokenizer import Tokenizer, build_tokenizer
from meshtrain.errors import ConfigError
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshtrain.generate",
        description="Continue a prompt with a meshtrain or Hugging Face checkpoint (greedy "
        "unless --temperature).",
    )
    parser.add_argument(
        "checkpoint",
        help="meshtrain checkpoint, checkpoints/ or run directory; or a Hugging Face directory "
        "(config.json, *.safetensors, tokenizer)",
    )
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer",
        help="tokenizer.json, sentencepiece .model or directory (default: the checkpoint's)",
    )
    parser.add_argument(
        "--mesh-shape", help='shard the model over the visible devices, e.g. [[4,2],["fsdp","tp"]]'
    )
    args = parser.parse_args(argv)
    # Not at the top: they import the training code.
    from meshtrain.checkpoint import find_checkpoints
    from meshtrain.checkpoint.model import checkpoint_config, load_checkpoint
    from meshtrain.hf.model import load_hf

    logging.basicConfig(format="meshtrain: %(message)s", level=logging.WARNING)
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's own lines about each read
    path = Path(args.checkpoint)
    try:
        if args.max_new_tokens < 1 or args.temperature < 0:
            raise ConfigError(
                f"--max-new-tokens={args.max_new_tokens} must be >= 1 and "
                f"--temperature={args.temperature} >= 0"
            )
        if not path.is_dir():
            raise ConfigError(
                f"{path} is not a directory; pass a meshtrain checkpoint (or its run directory) "
                "or a Hugging Face checkpoint directory (config.json, *.safetensors)"
            )
        is_meshtrain = bool(find_checkpoints(path))
        try:
            tokenizer = build_tokenizer(
                args.tokenizer
                or (checkpoint_config(path)["data"]["tokenizer"] if is_meshtrain else str(path))
            )
        except ValueError as err:
            raise ConfigError(str(err).replace("data.tokenizer", "--tokenizer")) from None
        try:
            mesh = json.loads(args.mesh_shape) if args.mesh_shape else None
        except json.JSONDecodeError:
            raise ConfigError(
                f"--mesh-shape={args.mesh_shape!r} is not JSON; write it like "
                '\'[[4,2],["fsdp","tp"]]\''
            ) from None
        model = load_checkpoint(path, mesh) if is_meshtrain else load_hf(path, mesh)
        if tokenizer.vocab_size > model.embed.shape[0]:
            raise ConfigError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                f"{model.embed.shape[0]} embeddings; pass the checkpoint's own --tokenizer"
            )
        completion = generate(
            model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, seed=args.seed
        )
    except ConfigError as err:
        print(f"meshtrain: error: {err}", file=sys.stderr)
        return 2
    print(args.prompt + completion)
    return 0


class _CallableModule(types.ModuleType):
    """`meshtrain.generate` names both this module (for `python -m`) and the function."""

    def __call__(self, *args, **kwargs) -> str:
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
