"""Packs tokenised documents into fixed-length training sequences, read on demand.

The documents of a split are laid out as one stream of `[bos] doc [eos]` blocks (`doc [eos]` for
a tokenizer without bos) and cut into consecutive, non-overlapping windows of seq_len + 1
tokens; the last window is padded with pad_id, or dropped for a tokenizer without pad. A
document longer than a window simply continues in the next one: nothing is dropped. Nothing is
materialised: a window is assembled from the prepared shards when it is read, so memory holds
only per-document arrays (16 bytes a document here, 24 in the corpus), whatever the corpus size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from meshtrain.data.tokenizer import NO_TOKEN

if TYPE_CHECKING:
    from meshtrain.data.shards import PreparedCorpus


class PackedDocuments:
    """Random-access packed sequences (int32 [seq_len + 1]) of chosen documents of prepared
    corpora, in the order given: corpus by corpus, each corpus's documents in index order."""

    def __init__(
        self,
        parts: Sequence[tuple[PreparedCorpus, np.ndarray]],
        *,
        seq_len: int,
        bos_id: int,
        eos_id: int,
        pad_id: int,
        vocab_size: int,
        split: str,
    ):
        """parts: (corpus, int64 [n] indices of its documents to pack), in stream order."""
        if seq_len < 1:
            raise ValueError(f"data.seq_len={seq_len} must be at least 1")
        self.seq_len, self.split, self.vocab_size = seq_len, split, vocab_size
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self._lead = 0 if bos_id == NO_TOKEN else 1  # special tokens before each document
        self._corpora = [corpus for corpus, _ in parts]
        self._corpus = np.concatenate(
            [np.full(len(docs), i, np.int32) for i, (_, docs) in enumerate(parts)] or [[]]
        ).astype(np.int32)  # [num_documents] which corpus each packed document is in
        self._document = np.concatenate(
            [np.asarray(docs, np.int64) for _, docs in parts] or [[]]
        ).astype(np.int64)  # [num_documents] its index in that corpus
        lengths = np.concatenate(
            [corpus.lengths[np.asarray(docs, np.int64)] for corpus, docs in parts] or [[]]
        ).astype(np.int64)
        self._blocks = lengths + self._lead + 1  # [num_documents] tokens of each block
        self._ends = np.cumsum(self._blocks)  # [num_documents] exclusive end of each block
        self.num_documents = len(lengths)
        self.num_tokens = int(self._ends[-1]) if len(lengths) else 0  # bos/eos included
        width = seq_len + 1
        if pad_id == NO_TOKEN:
            self._length = self.num_tokens // width
        else:
            self._length = -(-self.num_tokens // width)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self._length:
            raise IndexError(f"index {index} out of range for {self._length} sequences")
        width = self.seq_len + 1
        out = np.full(width, self.pad_id, np.int32)  # [seq_len + 1]
        position, stop = index * width, min((index + 1) * width, self.num_tokens)
        block = int(np.searchsorted(self._ends, position, side="right"))
        while position < stop:
            block_end = int(self._ends[block])
            take = min(block_end, stop) - position
            self._write_block(out, position - index * width, block, block_end, position, take)
            position += take
            block += 1
        return out

    def _write_block(
        self, out: np.ndarray, at: int, block: int, block_end: int, position: int, take: int
    ) -> None:
        """Writes tokens [position, position + take) of the stream, all inside `block`, to
        out[at:]."""
        begin = position - (block_end - int(self._blocks[block]))  # offset inside the block
        end = begin + take
        length = int(self._blocks[block]) - self._lead - 1  # the document's own tokens
        if begin < self._lead:
            out[at] = self.bos_id
        first, last = (
            max(begin, self._lead) - self._lead,
            min(end, self._lead + length) - self._lead,
        )
        if first < last:
            corpus = self._corpora[self._corpus[block]]
            start = at + first + self._lead - begin
            out[start : start + last - first] = corpus.read(int(self._document[block]), first, last)
        if end == self._lead + length + 1:
            out[at + take - 1] = self.eos_id
