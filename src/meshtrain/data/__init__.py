"""Data pipeline: documents → tokens (prepared shards) → packed sequences → deterministic,
resumable batches.

The names below are imported on first use, so that `python -m meshtrain.data.prepare` and its
worker processes load neither the config package nor JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "BatchIterator": "meshtrain.data.batches",
    "MixedDataset": "meshtrain.data.pipeline",
    "TokenDataset": "meshtrain.data.pipeline",
    "build_dataset": "meshtrain.data.pipeline",
    "build_datasets": "meshtrain.data.pipeline",
    "validation_batches": "meshtrain.data.batches",
    "PackedDocuments": "meshtrain.data.packing",
    "SyntheticDataset": "meshtrain.data.synthetic",
    "ByteTokenizer": "meshtrain.data.tokenizer",
    "build_tokenizer": "meshtrain.data.tokenizer",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'meshtrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
