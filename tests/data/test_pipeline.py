"""Tests of the data pipeline: tokenizer, corpus, packing, synthetic data and batch order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshtrain.config import DataConfig
from meshtrain.data import (
    BatchIterator,
    ByteTokenizer,
    SyntheticDataset,
    build_dataset,
    build_tokenizer,
    validation_batches,
)
from meshtrain.data.corpus import split_documents
from meshtrain.data.packing import pack_documents
from meshtrain.data.sources import list_documents, resolve_root

SEQ_LEN = 16


@pytest.fixture(scope="module")
def stdlib_paths() -> list[Path]:
    return list_documents(None, "**/*.py")


@pytest.fixture(scope="module")
def stdlib_train():
    return build_dataset(DataConfig(seq_len=SEQ_LEN), split="train", vocab_size=384)


class ArangeDataset:
    """Sequence i is filled with i, so a batch shows which indices it read."""

    vocab_size = 1000
    pad_id = -1
    seq_len = 3
    split = "train"

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(self.seq_len + 1, index, dtype=np.int32)


def batch_ids(batch: np.ndarray) -> np.ndarray:
    return batch[..., 0]  # [accum, rows]


def test_byte_tokenizer_ids_and_round_trip():
    tok = build_tokenizer("byte")
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258, 259)
    ids = tok.encode("aé")
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [97, 0xC3, 0xA9])
    assert tok.decode([257, *ids.tolist(), 258, 256]) == "aé"
    assert tok.decode(np.array([0xFF, 98])) == "\ufffdb"
    text = "def f(x):\n    return x  # ünïcødé ✓\n"
    assert tok.decode(tok.encode(text)) == text


def test_bad_tokenizer_message():
    with pytest.raises(
        ValueError,
        match=r"^data\.tokenizer='foo' is not supported; use byte, a tokenizer\.json file, a "
        r"sentencepiece \.model file, or a directory holding one$",
    ):
        build_tokenizer("foo")


def test_pack_documents_layout():
    docs = [np.array([1, 2, 3]), np.array([4]), np.array([], dtype=np.int32)]
    packed = pack_documents(docs, 3, bos_id=7, eos_id=8, pad_id=9)
    # stream: 7 1 2 3 8 | 7 4 8 | 7 8  → 11 tokens in windows of 4
    assert packed.dtype == np.int32
    np.testing.assert_array_equal(
        packed,
        [
            [7, 1, 2, 3],
            [8, 7, 4, 8],
            [7, 8, 9, 9],
        ],
    )


def test_pack_documents_exact_fit_and_empty():
    packed = pack_documents([np.array([5, 6])], 3, bos_id=7, eos_id=8, pad_id=9)
    np.testing.assert_array_equal(packed, [[7, 5, 6, 8]])
    assert pack_documents([], 3, bos_id=7, eos_id=8, pad_id=9).shape == (0, 4)


def test_split_is_deterministic_disjoint_and_near_fraction(stdlib_paths):
    root = resolve_root(None)
    train, validation = split_documents(stdlib_paths, 0.2, root=root)
    assert (train, validation) == split_documents(stdlib_paths, 0.2, root=root)
    assert not set(train) & set(validation)
    assert sorted(train + validation) == stdlib_paths
    assert 0.15 < len(validation) / len(stdlib_paths) < 0.25
    # The hash is of the path relative to the root, so the split does not depend on where it is.
    moved = [Path("/elsewhere") / p.relative_to(root) for p in stdlib_paths]
    _, moved_validation = split_documents(moved, 0.2, root=Path("/elsewhere"))
    assert [p.relative_to("/elsewhere") for p in moved_validation] == [
        p.relative_to(root) for p in validation
    ]
    assert split_documents(stdlib_paths, 0.0, root=root) == (stdlib_paths, [])
    # Without a root, the documents' common directory (here the stdlib root) is used.
    assert split_documents(stdlib_paths, 0.2) == (train, validation)


def test_bad_validation_fraction(stdlib_paths):
    with pytest.raises(ValueError, match=r"data\.validation_fraction=1\.0"):
        split_documents(stdlib_paths, 1.0)


def test_stdlib_train_split_loads(stdlib_train):
    assert stdlib_train.sequences.shape == (len(stdlib_train), SEQ_LEN + 1)
    assert stdlib_train.num_tokens > 1_000_000
    assert stdlib_train.vocab_size == 259 and stdlib_train.pad_id == 256
    first = stdlib_train[0]
    assert first.dtype == np.int32 and first[0] == ByteTokenizer.bos_id
    assert stdlib_train.sequences.min() >= 0 and stdlib_train.sequences.max() < 259
    # Only the last window has padding.
    assert not np.any(stdlib_train.sequences[:-1] == 256)


def test_empty_validation_split_and_iterator_error(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    cfg = DataConfig(path=str(tmp_path), glob="*.txt", validation_fraction=0.0, seq_len=4)
    validation = build_dataset(cfg, split="validation", vocab_size=259)
    assert len(validation) == 0
    with pytest.raises(ValueError, match="'validation' split has no sequences"):
        BatchIterator(validation, global_batch=2, accum_steps=1, rows=slice(0, 2), seed=0)
    train = build_dataset(cfg, split="train", vocab_size=259)
    np.testing.assert_array_equal(train.sequences, [[257, *b"hell"], [*b"o", 258, 256, 256, 256]])


def test_config_error_messages(tmp_path):
    with pytest.raises(
        ValueError, match=r"^data\.source='x' is not supported; use text_files or synthetic$"
    ):
        build_dataset(DataConfig(source="x"), split="train", vocab_size=384)
    with pytest.raises(ValueError, match=r"data\.tokenizer='foo' is not supported"):
        build_dataset(DataConfig(tokenizer="foo"), split="train", vocab_size=384)
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"data\.path=.*missing' is not a directory"):
        build_dataset(DataConfig(path=missing), split="train", vocab_size=384)
    with pytest.raises(ValueError, match=r"model\.vocab_size=100 is smaller"):
        build_dataset(DataConfig(), split="train", vocab_size=100)


def test_same_seed_same_batches_different_seed_different(stdlib_train):
    def first_batches(seed):
        it = BatchIterator(stdlib_train, global_batch=8, accum_steps=2, rows=slice(0, 4), seed=seed)
        return np.stack([next(it) for _ in range(3)])

    a, b, c = first_batches(0), first_batches(0), first_batches(1)
    assert a.shape == (3, 2, 4, SEQ_LEN + 1) and a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_start_step_and_state_resume():
    ds = ArangeDataset(37)
    fresh = BatchIterator(ds, global_batch=8, accum_steps=2, rows=slice(0, 4), seed=3)
    batches = [next(fresh) for _ in range(12)]
    assert fresh.get_state() == {"step": 12}
    for k in (0, 5, 11):  # step 5 straddles the first epoch boundary at 37
        resumed = BatchIterator(
            ds, global_batch=8, accum_steps=2, rows=slice(0, 4), seed=3, start_step=k
        )
        np.testing.assert_array_equal(next(resumed), batches[k])
    other = BatchIterator(ds, global_batch=8, accum_steps=2, rows=slice(0, 4), seed=3)
    other.set_state(json.loads(json.dumps({"step": 7})))
    np.testing.assert_array_equal(next(other), batches[7])
    assert other.get_state() == {"step": 8}


def test_accumulation_does_not_change_global_batch(stdlib_train):
    kwargs = dict(global_batch=8, seed=5)
    accum4 = BatchIterator(stdlib_train, accum_steps=4, rows=slice(0, 2), **kwargs)
    accum1 = BatchIterator(stdlib_train, accum_steps=1, rows=slice(0, 8), **kwargs)
    for _ in range(3):
        a, b = next(accum4), next(accum1)
        assert a.shape == (4, 2, SEQ_LEN + 1) and b.shape == (1, 8, SEQ_LEN + 1)
        np.testing.assert_array_equal(a.reshape(8, -1), b.reshape(8, -1))


def test_process_row_slices_concatenate_to_full_batch():
    ds = ArangeDataset(100)
    full = BatchIterator(ds, global_batch=16, accum_steps=2, rows=slice(0, 8), seed=1)
    p0 = BatchIterator(ds, global_batch=16, accum_steps=2, rows=slice(0, 4), seed=1)
    p1 = BatchIterator(ds, global_batch=16, accum_steps=2, rows=slice(4, 8), seed=1)
    for _ in range(3):
        np.testing.assert_array_equal(np.concatenate([next(p0), next(p1)], axis=1), next(full))


def test_epochs_are_distinct_permutations():
    ds = ArangeDataset(24)
    it = BatchIterator(ds, global_batch=6, accum_steps=3, rows=slice(0, 2), seed=0)
    ids = np.concatenate([batch_ids(next(it)).ravel() for _ in range(12)])  # 3 epochs
    epochs = ids.reshape(3, 24)
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(24))
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[0], np.arange(24))


def test_iterator_argument_errors():
    ds = ArangeDataset(10)
    with pytest.raises(ValueError, match="not divisible"):
        BatchIterator(ds, global_batch=6, accum_steps=4, rows=slice(0, 1), seed=0)
    with pytest.raises(ValueError, match="rows="):
        BatchIterator(ds, global_batch=8, accum_steps=4, rows=slice(0, 3), seed=0)
    with pytest.raises(ValueError, match="rows="):
        BatchIterator(ds, global_batch=8, accum_steps=4, rows=slice(None), seed=0)


def test_validation_batches_fixed_and_wrapping():
    ds = ArangeDataset(5)
    batches = validation_batches(ds, global_batch=4, num_batches=3, rows=slice(2, 4))
    assert [b.shape for b in batches] == [(2, 4)] * 3
    np.testing.assert_array_equal([b[:, 0] for b in batches], [[2, 3], [1, 2], [0, 1]])
    again = validation_batches(ds, global_batch=4, num_batches=3, rows=slice(2, 4))
    np.testing.assert_array_equal(batches, again)


def test_synthetic_range_and_determinism():
    cfg = DataConfig(source="synthetic", seq_len=SEQ_LEN)
    train = build_dataset(cfg, split="train", vocab_size=50)
    assert isinstance(train, SyntheticDataset)
    assert len(train) == 1_000_000 and train.pad_id == -1 and train.vocab_size == 50
    seqs = np.stack([train[i] for i in (0, 1, 999_999)])
    assert seqs.dtype == np.int32 and seqs.shape == (3, SEQ_LEN + 1)
    assert seqs.min() >= 0 and seqs.max() < 50
    np.testing.assert_array_equal(train[1], build_dataset(cfg, split="train", vocab_size=50)[1])
    assert not np.array_equal(train[0], train[1])
    assert not np.array_equal(train[0], build_dataset(cfg, split="validation", vocab_size=50)[0])
    big = np.concatenate([train[i] for i in range(200)])
    assert len(np.unique(big)) == 50
    with pytest.raises(IndexError):
        train[1_000_000]
