"""The `python -m meshtrain.data.prepare` command (meshtrain-prepare): tokenise documents, or
conversations with --chat, into a prepared directory.

    python -m meshtrain.data.prepare --out DIR [--tokenizer T] [--text-key K] [--workers N]
        [--on-bad-record error|skip] [--chat [--chat-template F] [--train-on ...]] PATH...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshtrain.data.bad_records import ON_BAD_RECORD
from meshtrain.data.chat.records import TRAIN_ON, chat_options_for
from meshtrain.data.prepare import prepare
from meshtrain.data.sources import resolve_paths
from meshtrain.errors import error_line
from meshtrain.prog import prog_name


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, like every meshtrain error
        print(error_line(f"{message} (see {self.prog} --help)"), file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    parser = _Parser(
        prog=prog_name("meshtrain.data.prepare"),
        description="Tokenise documents once into token shards that `data=prepared "
        "data.path=DIR` trains on. An interrupted run continues where it stopped when run again.",
    )
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="files, directories or globs: .jsonl, .jsonl.gz, .parquet, any other file is one "
        "document",
    )
    parser.add_argument("--out", type=Path, required=True, help="the prepared directory")
    parser.add_argument("--tokenizer", default="byte", help="as data.tokenizer (default: byte)")
    parser.add_argument(
        "--text-key", default="text", help="JSON key or parquet column of the text (default: text)"
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes (default: 1)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the records are conversations (messages, or prompt and completion): rendered with "
        "the tokenizer's chat template and marked for the loss, for data=chat (docs/finetuning.md)",
    )
    parser.add_argument("--chat-template", help="as data.chat_template (--chat)")
    parser.add_argument("--train-on", choices=TRAIN_ON, help="as data.train_on (--chat)")
    parser.add_argument("--messages-key", default="messages", help="as data.messages_key (--chat)")
    parser.add_argument("--prompt-key", default="prompt", help="as data.prompt_key (--chat)")
    parser.add_argument(
        "--completion-key", default="completion", help="as data.completion_key (--chat)"
    )
    parser.add_argument(
        "--on-bad-record",
        choices=ON_BAD_RECORD,
        default="error",
        help="stop at a bad record (default), or skip and count it",
    )
    args = parser.parse_args(argv)
    try:
        files, root = resolve_paths(args.paths, key="PATH")
        prepare(
            files,
            args.out,
            root=root,
            tokenizer=args.tokenizer,
            text_key=args.text_key,
            chat=_chat(args),
            on_bad_record=args.on_bad_record,
            workers=args.workers,
            progress=True,
        )
    except ValueError as err:  # DataError, and build_tokenizer's ValueError for a bad name
        print(error_line(str(err)), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(
            error_line(f"interrupted; run the same command to resume into {args.out}"),
            file=sys.stderr,
        )
        sys.exit(130)


def _chat(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.chat:
        return None
    return chat_options_for(
        args.tokenizer,
        chat_template=args.chat_template,
        train_on=args.train_on,
        messages_key=args.messages_key,
        prompt_key=args.prompt_key,
        completion_key=args.completion_key,
    )


if __name__ == "__main__":
    main()
