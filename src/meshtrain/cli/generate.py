"""`python -m meshtrain.generate <checkpoint> "prompt" [--max-new-tokens 32]` (or
`meshtrain-generate`): continue a prompt, greedy unless --temperature.

<checkpoint> is a meshtrain checkpoint (a step directory, its checkpoints/ directory, a run
directory or an orbax export; the tokenizer is the one it was trained with) or a Hugging Face
checkpoint directory (config.json, *.safetensors and the tokenizer).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from meshtrain.checkpoint import find_checkpoints
from meshtrain.cli.exit import fail
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import ConfigError
from meshtrain.inference.generate import generate
from meshtrain.inference.load import checkpoint_config, load_checkpoint, load_hf


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
        fail(str(err))
    print(args.prompt + completion)
    return 0


if __name__ == "__main__":
    sys.exit(main())
