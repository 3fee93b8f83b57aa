"""Data pipeline: documents → tokens (prepared shards) → packed sequences → deterministic,
resumable batches."""

from meshtrain.data.packing import PackedDocuments
from meshtrain.data.pipeline import (
    BatchIterator,
    MixedDataset,
    TokenDataset,
    build_dataset,
    source_shares,
    validation_batches,
)
from meshtrain.data.synthetic import SyntheticDataset
from meshtrain.data.tokenizer import ByteTokenizer, build_tokenizer

__all__ = [
    "BatchIterator",
    "ByteTokenizer",
    "MixedDataset",
    "PackedDocuments",
    "SyntheticDataset",
    "TokenDataset",
    "build_dataset",
    "build_tokenizer",
    "source_shares",
    "validation_batches",
]
