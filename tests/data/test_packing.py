"""Packing documents into sequences, read on demand: the `[bos] doc [eos]` stream cut into
windows, long documents split across windows and never dropped, the last window padded."""

import numpy as np
import pytest

from meshtrain.data.packing import PackedDocuments
from meshtrain.data.tokenizer import NO_TOKEN


class ListCorpus:
    """The parts of a PreparedCorpus that packing reads, over documents in memory."""

    def __init__(self, documents):
        self.documents = [np.asarray(d, np.int32) for d in documents]
        self.lengths = np.array([len(d) for d in documents], np.int64)
        self.num_documents = len(documents)

    def read(self, document, start, stop):
        return self.documents[document][start:stop]


def reference(documents, seq_len, *, bos, eos, pad):
    """The stream built in full, then cut: what PackedDocuments must read window by window."""
    lead = [] if bos == NO_TOKEN else [bos]
    stream = np.concatenate([[*lead, *d, eos] for d in documents]).astype(np.int32)
    width = seq_len + 1
    if pad == NO_TOKEN:
        return stream[: len(stream) // width * width].reshape(-1, width)
    padded = np.full(-(-len(stream) // width) * width, pad, np.int32)
    padded[: len(stream)] = stream
    return padded.reshape(-1, width)


def packed(parts, seq_len, bos=7, eos=8, pad=9):
    return PackedDocuments(
        parts, seq_len=seq_len, bos_id=bos, eos_id=eos, pad_id=pad, vocab_size=10, split="train"
    )


def test_layout_of_short_documents():
    corpus = ListCorpus([[1, 2], [3], [4, 5, 6]])
    dataset = packed([(corpus, np.arange(3))], seq_len=3)
    rows = np.stack([dataset[i] for i in range(len(dataset))])
    np.testing.assert_array_equal(rows, [[7, 1, 2, 8], [7, 3, 8, 7], [4, 5, 6, 8]])
    assert dataset.num_tokens == 12 and dataset.num_documents == 3


@pytest.mark.parametrize("bos,pad", [(7, 9), (NO_TOKEN, 9), (7, NO_TOKEN), (NO_TOKEN, NO_TOKEN)])
@pytest.mark.parametrize("seq_len", [1, 4, 16, 63])
def test_every_window_equals_the_stream_cut_in_full(bos, pad, seq_len):
    rng = np.random.default_rng(seq_len)
    # Empty documents, documents many windows long, and everything between.
    documents = [rng.integers(0, 7, n) for n in rng.choice([0, 1, 5, 40, 200], size=30)]
    expected = reference(documents, seq_len, bos=bos, eos=8, pad=pad)
    dataset = packed([(ListCorpus(documents), np.arange(30))], seq_len, bos=bos, pad=pad)
    assert len(dataset) == len(expected)
    for i in range(len(expected)):
        np.testing.assert_array_equal(dataset[i], expected[i])


def test_long_documents_are_split_never_dropped():
    document = np.arange(100) % 7
    dataset = packed([(ListCorpus([document]), np.arange(1))], seq_len=9)
    stream = np.concatenate([dataset[i] for i in range(len(dataset))])
    assert len(dataset) == 11  # 102 tokens in windows of 10, the last padded
    np.testing.assert_array_equal(stream[1:101], document)
    assert (stream[0], stream[101]) == (7, 8) and set(stream[102:]) == {9}


def test_chosen_documents_of_several_corpora_in_order():
    first, second = ListCorpus([[1], [2], [3]]), ListCorpus([[4, 4], [5]])
    dataset = packed([(first, np.array([0, 2])), (second, np.array([1, 0]))], seq_len=2)
    stream = np.concatenate([dataset[i] for i in range(len(dataset))])
    np.testing.assert_array_equal(stream, [7, 1, 8, 7, 3, 8, 7, 5, 8, 7, 4, 4, 8, 9, 9])


def test_empty_and_out_of_range():
    dataset = packed([(ListCorpus([]), np.arange(0))], seq_len=4)
    assert len(dataset) == 0 and dataset.num_tokens == 0
    with pytest.raises(IndexError):
        dataset[0]
    with pytest.raises(ValueError, match=r"data\.seq_len=0"):
        packed([], seq_len=0)
