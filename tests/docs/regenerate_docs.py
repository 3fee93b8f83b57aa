"""Reruns the commands whose output README.md and docs/ show in checked blocks, and rewrites those
blocks in place, with the step-1 losses the prose quotes from them.

    python tests/docs/regenerate_docs.py [DOC ...] [--check] [--list]

A checked block is a ```text block after `<!-- output: checked (python X, jax Y) -->`
(tests/helpers/doc_outputs.py): the doc tests run the command of the bash block before it, as
written, and compare. After a change that alters what a documented run prints (the default run,
a log line, the memory plan), run this script and review `git diff docs/`.

Each command runs as a user would run it, in a scratch directory (its run directory shown as
/home/me/meshtrain/outputs/...), with a cold JAX compilation cache of its own (compile times as a
first launch), without the tests' fast-compile flags. A block shows some of the lines a run
prints: each documented line is replaced by the output line of the same shape, and the block's
marker gets this Python's and JAX's versions. A documented line with no counterpart is kept and
reported: edit it by hand. All checked blocks take about 6 minutes on 2 cores (Gemma 3 27B
unrolled and the launcher's 200 steps take most); give DOCs to rerun only theirs. --check
compares without writing and exits with 1 on a difference; --list prints the commands.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from helpers.doc_outputs import (  # noqa: E402
    DOCS,
    QUOTES,
    OutputBlock,
    compare,
    environment,
    marker,
    output_blocks,
    quoted_loss,
)

SHOWN_CHECKOUT = "/home/me/meshtrain"  # where the docs' runs appear to run


def command_line(command: str) -> tuple[dict[str, str], list[str]]:
    """A documented command as (its environment prefix, its argv), with run_training.py
    named by its path in this checkout."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words[0] == "python", command
    argv = [sys.executable, *(str(REPO / w) if w == "run_training.py" else w for w in words[1:])]
    return env, argv


def run(command: str, workdir: Path) -> str:
    """The command's output (stderr, then stdout), run in `workdir` as a user runs it."""
    env_vars, argv = command_line(command)
    env = {**os.environ, **env_vars, "JAX_PLATFORMS": "cpu"}
    env["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-", dir=workdir)
    for name in ("HYDRA_FULL_ERROR", "MESHTRAIN_RUN_ID", "MESHTRAIN_DEBUG"):
        env.pop(name, None)
    start = time.perf_counter()
    result = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True)
    print(f"  ran in {time.perf_counter() - start:.0f} s: {command}", file=sys.stderr)
    if result.returncode != 0:
        raise SystemExit(f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return (result.stderr + "\n" + result.stdout).replace(str(workdir), SHOWN_CHECKOUT)


def regenerate(block: OutputBlock, output: str) -> tuple[list[str], list[str]]:
    """The block's new lines, and the documented lines no output line has the shape of."""
    comparison = compare(list(block.block.lines), output)
    lines, missing = [], []
    for documented, got in zip(comparison.documented, comparison.matched, strict=True):
        lines.append(got if got is not None else documented)
        if got is None:
            missing.append(documented)
    return lines, missing


def rewrite(doc: str, new_blocks: dict[int, list[str]]) -> None:
    """Replaces the lines of the checked blocks (by their first line) and their markers."""
    path = REPO / doc
    lines = path.read_text().split("\n")
    for block in output_blocks(doc):
        if block.block.lineno not in new_blocks:
            continue
        first = block.block.lineno - 1
        lines[first : first + len(block.block.lines)] = new_blocks[block.block.lineno]
        lines[block.marker_lineno - 1] = marker("checked")
    path.write_text("\n".join(lines))


def rewrite_quotes() -> list[str]:
    """The prose's quoted step-1 losses set to the checked log's; the docs changed."""
    loss = quoted_loss()
    changed = []
    for quote in QUOTES:
        path = REPO / quote.doc
        text = path.read_text()
        new = quote.pattern.sub(lambda m: m.group(0).replace(m.group(1), loss), text)
        if new != text:
            path.write_text(new)
            changed.append(quote.doc)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("docs", nargs="*", help="e.g. docs/planning.md; default: all")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a change")
    parser.add_argument("--list", action="store_true", help="print the checked commands")
    args = parser.parse_args(argv)
    docs = args.docs or list(DOCS)
    differ = 0
    with tempfile.TemporaryDirectory(prefix="meshtrain-docs-") as scratch:
        for doc in docs:
            new_blocks = {}
            for block in (b for b in output_blocks(doc) if b.kind == "checked"):
                where = f"{doc}:{block.block.lineno}"
                if args.list:
                    print(f"{where}: {block.command}")
                    continue
                workdir = Path(tempfile.mkdtemp(dir=scratch))
                lines, missing = regenerate(block, run(block.command, workdir))
                for line in missing:
                    print(f"{where}: no output line like (edit it by hand): {line}")
                if lines != list(block.block.lines) or block.versions != environment():
                    differ += 1
                    print(f"{where}: {'differs' if args.check else 'rewritten'}")
                    new_blocks[block.block.lineno] = lines
            if new_blocks and not args.check:
                rewrite(doc, new_blocks)
    if not args.check and not args.list:
        for doc in rewrite_quotes():
            print(f"{doc}: the quoted step-1 loss rewritten")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
