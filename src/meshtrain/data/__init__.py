"""Data pipeline: documents → tokens → packed sequences → deterministic, resumable batches."""

from meshtrain.data.pipeline import (
    BatchIterator,
    PackedTextDataset,
    TokenDataset,
    build_dataset,
    validation_batches,
)
from meshtrain.data.synthetic import SyntheticDataset
from meshtrain.data.tokenizer import ByteTokenizer, build_tokenizer

__all__ = [
    "BatchIterator",
    "ByteTokenizer",
    "PackedTextDataset",
    "SyntheticDataset",
    "TokenDataset",
    "build_dataset",
    "build_tokenizer",
    "validation_batches",
]
