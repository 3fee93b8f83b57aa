"""A run's tokenizer found again after it moved: a run records data.tokenizer as an absolute
path (config.locations), which a project directory moved or copied elsewhere no longer
reaches. The run directory usually moved with it, so the tokenizer is looked for where the
recorded path's tail lands under the run directory's ancestors, and taken only if its files'
contents are the ones the checkpoint recorded (data.shards.tokenizer_identity)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from meshtrain.data.shards import tokenizer_identity

log = logging.getLogger(__name__)


def find_moved_tokenizer(recorded: str, identity: dict[str, Any], near: Path) -> Path | None:
    """The path, under an ancestor of `near` (the run's checkpoint directory), that ends with a
    tail of `recorded` and holds a tokenizer of `identity`; None if there is none."""
    parts = Path(recorded).parts[1:]  # without the root
    for ancestor in Path(near).resolve().parents:
        for start in range(len(parts)):
            candidate = ancestor.joinpath(*parts[start:])
            if candidate.exists() and _identity(candidate) == identity:
                log.warning(
                    "data.tokenizer %s is gone; using %s, which holds the same files",
                    recorded,
                    candidate,
                )
                return candidate
    return None


def _identity(path: Path) -> dict[str, Any] | None:
    try:
        return tokenizer_identity(str(path))
    except (OSError, ValueError):
        return None
