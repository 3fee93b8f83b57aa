"""Finds the text documents of a corpus, splits them into train/validation and reads their tokens."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from meshtrain.data.tokenizer import Tokenizer

# Installed third-party packages are not corpus text, and a virtualenv may live under them. With a
# venv, sysconfig's stdlib still points at the base interpreter's lib/pythonX.Y, whose
# site-packages holds that interpreter's packages; Debian's system Python uses dist-packages.
_PRUNED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def resolve_root(path: str | None) -> Path:
    """Returns the corpus directory: `path`, or the standard library's source if None."""
    root = Path(sysconfig.get_paths()["stdlib"] if path is None else path).expanduser()
    if not root.is_dir():
        raise ValueError(
            f"data.path={path!r} is not a directory; point it at a folder of text documents "
            "or set it to null for the Python standard library"
        )
    return root


def _matches(parts: Sequence[str], pattern: Sequence[str]) -> bool:
    """Glob match of path components, where `**` stands for zero or more directories."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return (
        bool(parts)
        and fnmatch.fnmatchcase(parts[0], pattern[0])
        and _matches(parts[1:], pattern[1:])
    )


def list_documents(path: str | None, glob: str) -> list[Path]:
    """Returns the readable files under the corpus root that match `glob`, sorted.

    Walks the tree itself instead of using Path.glob so that site-packages is pruned rather than
    walked and filtered: under a pyenv or system install it can hold ten times the stdlib's files.
    """
    root = resolve_root(path)
    pattern = Path(glob).parts
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _PRUNED_DIRS]
        rel_dir = Path(dirpath).relative_to(root).parts
        for name in filenames:
            file = Path(dirpath, name)
            if _matches((*rel_dir, name), pattern) and file.is_file() and os.access(file, os.R_OK):
                found.append(file)
    if not found:
        raise ValueError(f"data.glob={glob!r} matches no readable file under {str(root)!r}")
    return sorted(found)


def split_documents(
    paths: Sequence[Path], validation_fraction: float, *, root: Path | None = None
) -> tuple[list[Path], list[Path]]:
    """Splits documents into (train, validation) by a stable hash of each path relative to `root`.

    Hashing the relative path (not Python's per-process salted `hash`) makes the split the same on
    every machine and for every seed. `root` defaults to the documents' common directory.
    """
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(
            f"data.validation_fraction={validation_fraction!r} must be in [0, 1), e.g. 0.05"
        )
    if root is None:
        root = Path(os.path.commonpath([p.parent for p in paths])) if paths else Path()
    train, validation = [], []
    for p in paths:
        digest = hashlib.sha256(p.relative_to(root).as_posix().encode()).digest()
        draw = int.from_bytes(digest[:8], "little") / 2**64  # uniform in [0, 1)
        (validation if draw < validation_fraction else train).append(p)
    return train, validation


def read_tokens(paths: Sequence[Path], tokenizer: Tokenizer) -> list[np.ndarray]:
    """Returns each document's token ids (int32 [doc_len]), read as raw bytes."""
    return [tokenizer.encode_bytes(p.read_bytes()) for p in paths]
