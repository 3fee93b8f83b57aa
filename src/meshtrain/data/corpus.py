"""Splits the documents of a corpus into train/validation and reads their tokens (finding them is
meshtrain.data.sources; the prepared shards of meshtrain.data.shards supersede this module)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from meshtrain.data.sources import list_documents, resolve_root
from meshtrain.data.tokenizer import Tokenizer

__all__ = ["list_documents", "read_tokens", "resolve_root", "split_documents"]


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
