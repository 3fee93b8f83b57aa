"""`python -m meshtrain.generate <checkpoint> "prompt" [--max-new-tokens 32]` (or
`meshtrain-generate`): continue a prompt, greedy unless --temperature.

<checkpoint> is a meshtrain checkpoint (a step directory, its checkpoints/ directory, a run
directory), any `meshtrain.export` output (orbax, safetensors or hf), or a Hugging Face
checkpoint directory (config.json, *.safetensors). The tokenizer is the one the run trained
with, else the one the directory carries (inference.load.load_tokenizer), unless --tokenizer.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from meshtrain.cli.exit import fail
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import ConfigError
from meshtrain.inference.generate import generate
from meshtrain.inference.load import load_model, load_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshtrain.generate",
        description="Continue a prompt with a meshtrain or Hugging Face checkpoint (greedy "
        "unless --temperature).",
    )
    parser.add_argument(
        "checkpoint",
        help="meshtrain checkpoint, checkpoints/ or run directory; a meshtrain.export output; "
        "or a Hugging Face directory (config.json, *.safetensors, tokenizer)",
    )
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer",
        help="byte, a tokenizer.json, a sentencepiece .model or a directory holding one "
        "(default: the one the checkpoint trained with or carries)",
    )
    parser.add_argument(
        "--mesh-shape", help='shard the model over the visible devices, e.g. [[4,2],["fsdp","tp"]]'
    )
    args = parser.parse_args(argv)
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
        if args.tokenizer is None:
            tokenizer = load_tokenizer(path)
        else:
            try:
                tokenizer = build_tokenizer(args.tokenizer)
            except ValueError as err:
                raise ConfigError(str(err).replace("data.tokenizer", "--tokenizer")) from None
        try:
            mesh = json.loads(args.mesh_shape) if args.mesh_shape else None
        except json.JSONDecodeError:
            raise ConfigError(
                f"--mesh-shape={args.mesh_shape!r} is not JSON; write it like "
                '\'[[4,2],["fsdp","tp"]]\''
            ) from None
        model = load_model(path, mesh)
        if tokenizer.vocab_size > model.embed.shape[0]:
            raise ConfigError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                f"{model.embed.shape[0]} embeddings; pass the checkpoint's own --tokenizer"
            )
        completion = generate(
            model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, seed=args.seed
        )
    except ConfigError as err:
        fail(str(err))
    print(args.prompt + completion)
    return 0


if __name__ == "__main__":
    sys.exit(main())
