"""`python -m meshtrain.generate <checkpoint> "prompt" [--max-new-tokens 32]` (or
`meshtrain-generate`): continue a prompt, greedy unless --temperature.

<checkpoint> is a meshtrain checkpoint (a step directory, its checkpoints/ directory, a run
directory), any `meshtrain.export` output (orbax, safetensors or hf), or a Hugging Face
checkpoint directory (config.json, *.safetensors). The tokenizer is the one the run trained
with, else the one the directory carries (weights.load.load_tokenizer), unless --tokenizer.

With --chat the prompt is a user message (after a --system message if given), or --messages
FILE.json holds the conversation; it is rendered with the tokenizer's chat template (the files
beside the tokenizer, as data.chat_template reads them) or --chat-template FILE.jinja, and only
the assistant's answer is printed: up to the template's end-of-turn token, eos or
--max-new-tokens (inference.generate.generate_chat).

With --prompts FILE (a .txt of one prompt per line, or a .jsonl of {"prompt": ...} records, the
prompt a string, or with --chat a string or a list of messages) the prompts are generated in
batches of --batch-size, and each result is printed as one JSON line, {"prompt", "completion"}.
--temperature samples (--seed), within --top-k and --top-p if given.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from functools import partial
from pathlib import Path

from meshtrain.cli.exit import fail
from meshtrain.cli.train import skip_gpu_plugin_without_gpu
from meshtrain.data.chat.encoder import ChatEncoder, build_chat_encoder
from meshtrain.data.tokenizer import Tokenizer, build_tokenizer
from meshtrain.errors import ConfigError
from meshtrain.inference.generate import answer_chats, complete_texts
from meshtrain.prog import prog_name
from meshtrain.weights.load import load_model, load_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog_name("meshtrain.generate"),
        description="Continue a prompt with a meshtrain or Hugging Face checkpoint, or answer "
        "it as a chat message (--chat); greedy unless --temperature.",
    )
    parser.add_argument(
        "checkpoint",
        help="meshtrain checkpoint, checkpoints/ or run directory; a meshtrain.export output; "
        "or a Hugging Face directory (config.json, *.safetensors, tokenizer)",
    )
    parser.add_argument(
        "prompt", nargs="?", help="the text to continue; with --chat, the user's message"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=32,
        help="the most tokens to generate (default 32); it stops earlier at eos, and with "
        "--chat at the template's end-of-turn token",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sample"
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the fewest most likely tokens whose probabilities reach p (1: all)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prompts",
        metavar="FILE",
        help='generate for every prompt of FILE (.txt: one per line; .jsonl: {"prompt": ...}) '
        'and print one JSON line each, {"prompt", "completion"}',
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="with --prompts: prompts generated together (default 32)",
    )
    parser.add_argument(
        "--tokenizer",
        help="byte, a tokenizer.json, a sentencepiece .model or a directory holding one "
        "(default: the one the checkpoint trained with or carries)",
    )
    parser.add_argument(
        "--mesh-shape", help='shard the model over the visible devices, e.g. [[4,2],["fsdp","tp"]]'
    )
    chat = parser.add_argument_group(
        "chat", "answer a conversation in the tokenizer's chat template; print only the answer"
    )
    chat.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message: render it with the chat template, generate until "
        "the template's end-of-turn token or eos",
    )
    chat.add_argument("--system", help="with --chat: a system message before the user's")
    chat.add_argument(
        "--messages",
        metavar="FILE.json",
        help='the conversation instead of the prompt: a JSON list of {"role", "content"} '
        "(system, user, assistant); implies --chat",
    )
    chat.add_argument(
        "--chat-template",
        metavar="FILE.jinja",
        help="the chat template to use instead of the tokenizer's own",
    )
    args = parser.parse_intermixed_args(argv)  # the prompt before or after the options
    args.chat = args.chat or args.messages is not None
    logging.basicConfig(format="meshtrain: %(message)s", level=logging.WARNING)
    skip_gpu_plugin_without_gpu()  # before JAX starts: no CUDA failure printed on a CPU host
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's own lines about each read
    path = Path(args.checkpoint)
    try:
        if args.max_new_tokens < 1 or args.temperature < 0:
            raise ConfigError(
                f"--max-new-tokens={args.max_new_tokens} must be >= 1 and "
                f"--temperature={args.temperature} >= 0"
            )
        _check_sampling(args)
        _check_prompt(args)
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
        # Before the model loads: a conversation the template cannot render.
        encoder = _chat_encoder(tokenizer, args.chat_template) if args.chat else None
        given, prompts = _prompts(args, encoder)
        model = load_model(path, mesh)
        if tokenizer.vocab_size > model.embed.shape[0]:
            raise ConfigError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                f"{model.embed.shape[0]} embeddings; pass the checkpoint's own --tokenizer"
            )
        generate = (
            partial(complete_texts, model, tokenizer)
            if encoder is None
            else partial(answer_chats, model, encoder)
        )
        sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        for first in range(0, len(prompts), args.batch_size):
            batch = slice(first, first + args.batch_size)
            outputs = generate(
                prompts[batch], args.max_new_tokens, seed=args.seed + first, **sampling
            )
            for prompt, output in zip(given[batch], outputs, strict=True):
                if args.prompts is not None:
                    print(json.dumps({"prompt": prompt, "completion": output}), flush=True)
                else:
                    print(output if args.chat else args.prompt + output)
    except ConfigError as err:
        fail(str(err))
    return 0


def _check_sampling(args: argparse.Namespace) -> None:
    """--top-k and --top-p sample, with sensible values; --batch-size goes with --prompts."""
    if args.top_k < 0 or not 0 < args.top_p <= 1:
        raise ConfigError(
            f"--top-k={args.top_k} must be >= 0 (0: all tokens) and --top-p={args.top_p} in "
            "(0, 1] (1: all tokens)"
        )
    if args.temperature == 0 and (args.top_k > 0 or args.top_p < 1):
        raise ConfigError(
            "--top-k and --top-p choose among the tokens to sample, but --temperature=0 picks "
            "the most likely one; set --temperature (e.g. 1.0) to sample"
        )
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size={args.batch_size} must be >= 1")


def _check_prompt(args: argparse.Namespace) -> None:
    """The prompt, --prompts, --messages and the chat options go together as --help says."""
    if args.prompts is not None:
        given = {
            "the prompt argument": args.prompt,
            "--messages": args.messages,
            "--system": args.system,
        }
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise ConfigError(f"--prompts holds every prompt; drop {' and '.join(extra)}")
        return
    if not args.chat:
        options = {"--system": args.system, "--chat-template": args.chat_template}
        extra = [name for name, value in options.items() if value is not None]
        if extra:
            verb = "goes" if len(extra) == 1 else "go"
            raise ConfigError(f"{' and '.join(extra)} {verb} with --chat")
        if args.prompt is None:
            raise ConfigError("no prompt; pass the text to continue after the checkpoint")
    elif args.messages is not None and args.prompt is not None:
        raise ConfigError("--messages holds the whole conversation; pass no prompt with it")
    elif args.messages is not None and args.system is not None:
        raise ConfigError(
            "--messages holds the whole conversation; put the system message in it, not in --system"
        )
    elif args.messages is None and args.prompt is None:
        raise ConfigError("no prompt; pass the user's message, or --messages FILE.json")


def _chat_encoder(tokenizer: Tokenizer, chat_template: str | None) -> ChatEncoder:
    """The chat encoder of the tokenizer's files, its errors in this command's words."""
    name = str(tokenizer.source_files[0]) if tokenizer.source_files else "byte"
    try:
        return build_chat_encoder(name, chat_template)
    except ConfigError as err:
        message = str(err).replace("data.chat_template", "--chat-template")
        raise ConfigError(message.replace("data.tokenizer=", "tokenizer ")) from None


def _prompts(args: argparse.Namespace, encoder: ChatEncoder | None) -> tuple[list, list]:
    """The prompts as given (each of --prompts' lines or records, else the one prompt) and as
    generated for: texts, or with --chat conversations, each checked by rendering it."""
    if args.prompts is None:
        return [args.prompt], [args.prompt if encoder is None else _messages(args, encoder)]
    file = Path(args.prompts)
    if not file.is_file():
        raise ConfigError(f"--prompts={args.prompts!r} is not a file")
    given, prompts = [], []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"--prompts {file}:{number}"
        prompt = line
        if file.suffix == ".jsonl":
            try:
                prompt = json.loads(line)["prompt"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    f'{where}: a .jsonl line must be a record with "prompt" (a string, or with '
                    "--chat a list of messages)"
                ) from None
        if encoder is None and not isinstance(prompt, str):
            raise ConfigError(f"{where}: the prompt is not a string; pass --chat for messages")
        given.append(prompt)
        if encoder is not None:
            prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            try:
                encoder.render_generation_prompt(prompt)
            except ValueError as err:  # not a conversation (DataError)
                raise ConfigError(f"{where}: {err}") from None
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"--prompts={args.prompts!r} holds no prompt")
    return given, prompts


def _messages(args: argparse.Namespace, encoder: ChatEncoder) -> list:
    """The conversation, checked by rendering it: --messages' file, or [--system,] the prompt as
    the user's message."""
    if args.messages is None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        messages = [*system, {"role": "user", "content": args.prompt}]
        encoder.render_generation_prompt(messages)
        return messages
    file = Path(args.messages)
    if not file.is_file():
        raise ConfigError(f"--messages={args.messages!r} is not a file")
    try:
        messages = json.loads(file.read_text(encoding="utf-8"))
        encoder.render_generation_prompt(messages)
    except ValueError as err:  # not JSON, not UTF-8, or not a conversation (DataError)
        raise ConfigError(f"--messages={args.messages!r}: {err}") from None
    return messages


if __name__ == "__main__":
    sys.exit(main())
