"""Tests of the data pipeline: tokenizer, corpus, packing, synthetic data and batch order."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers.tiny_tokenizers import train_bpe

from meshtrain.config import DataConfig
from meshtrain.config.data import MixtureSource
from meshtrain.data import (
    BatchIterator,
    ByteTokenizer,
    MixedDataset,
    SyntheticDataset,
    build_dataset,
    build_tokenizer,
    validation_batches,
)
from meshtrain.data.shards import document_draw
from meshtrain.errors import DataError

SEQ_LEN = 16


@pytest.fixture(scope="module")
def stdlib_train():
    return build_dataset(
        DataConfig(seq_len=SEQ_LEN, on_bad_record="skip"), split="train", vocab_size=384
    )


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


def rows(dataset) -> np.ndarray:
    return np.stack([dataset[i] for i in range(len(dataset))])


def stream_bytes(dataset) -> bytes:
    """The bytes of a byte-tokenised dataset's documents, specials and padding left out."""
    tokens = rows(dataset).ravel() if len(dataset) else np.zeros(0, np.int32)
    return tokens[tokens < 256].astype(np.uint8).tobytes()


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


def test_split_is_by_a_stable_hash_of_each_document(tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    for i in range(60):
        (root / f"doc{i}.txt").write_text(f"<{i}>")
    cfg = DataConfig(
        path=str(root), glob="*.txt", validation_fraction=0.3, seq_len=8, cache_dir=None
    )
    found = {
        split: set(
            map(
                int,
                re.findall(
                    rb"<(\d+)>", stream_bytes(build_dataset(cfg, split=split, vocab_size=259))
                ),
            )
        )
        for split in ("train", "validation")
    }
    # The draw hashes the path relative to the root, so the split is the same wherever the
    # corpus lives, and on every machine and seed.
    held_out = {i for i in range(60) if document_draw(f"doc{i}.txt") < 0.3}
    assert found["validation"] == held_out and found["train"] == set(range(60)) - held_out
    assert 10 < len(held_out) < 26


def test_stdlib_train_split_loads(stdlib_train):
    assert stdlib_train.num_tokens > 1_000_000
    assert len(stdlib_train) == -(-stdlib_train.num_tokens // (SEQ_LEN + 1))
    assert stdlib_train.vocab_size == 259 and stdlib_train.pad_id == 256
    first = stdlib_train[0]
    assert first.dtype == np.int32 and first.shape == (SEQ_LEN + 1,)
    assert first[0] == ByteTokenizer.bos_id
    sample = np.stack([stdlib_train[i] for i in range(0, len(stdlib_train), 997)])
    assert sample.min() >= 0 and sample.max() < 259
    # Only the last window has padding.
    assert not np.any(sample == 256) and stdlib_train[len(stdlib_train) - 1][-1] == 256


def test_empty_validation_split_and_iterator_error(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    cfg = DataConfig(path=str(tmp_path), glob="*.txt", validation_fraction=0.0, seq_len=4)
    validation = build_dataset(cfg, split="validation", vocab_size=259)
    assert len(validation) == 0
    with pytest.raises(ValueError, match="'validation' split has no sequences"):
        BatchIterator(validation, global_batch=2, accum_steps=1, rows=slice(0, 2), seed=0)
    train = build_dataset(cfg, split="train", vocab_size=259)
    np.testing.assert_array_equal(rows(train), [[257, *b"hell"], [*b"o", 258, 256, 256, 256]])


def test_config_error_messages(tmp_path):
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
    assert fresh.get_state() == {"step": 12, "position": 96}
    for k in (0, 5, 11):  # step 5 straddles the first epoch boundary at 37
        resumed = BatchIterator(
            ds, global_batch=8, accum_steps=2, rows=slice(0, 4), seed=3, start_step=k
        )
        np.testing.assert_array_equal(next(resumed), batches[k])
    other = BatchIterator(ds, global_batch=8, accum_steps=2, rows=slice(0, 4), seed=3)
    other.set_state(json.loads(json.dumps({"step": 7})))
    np.testing.assert_array_equal(next(other), batches[7])
    assert other.get_state() == {"step": 8, "position": 64}


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


def write_sources(root: Path) -> dict[str, list[str]]:
    """One file of each format; returns the documents of each file, in file order."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    documents = {
        "a.jsonl": ["first record", "second record"],
        "b.jsonl.gz": ["gzipped one", "gzipped two", "gzipped three"],
        "c.parquet": [f"row {i} of the table" for i in range(5)],
        "d.md": ["# a markdown file\n\nwhole file, one document\n"],
    }
    (root / "a.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in documents["a.jsonl"])
    )
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.writelines(
            json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(documents["b.jsonl.gz"])
        )
    pq.write_table(pa.table({"text": documents["c.parquet"]}), root / "c.parquet", row_group_size=2)
    (root / "d.md").write_text(documents["d.md"][0])
    return documents


def text_config(**changes) -> DataConfig:
    return DataConfig(**{"seq_len": 8, "validation_fraction": 0.0, "cache_dir": None, **changes})


def test_every_format_trains_as_documents_in_file_and_record_order(tmp_path):
    documents = write_sources(tmp_path / "data")
    cfg = text_config(paths=[str(tmp_path / "data")])
    train = build_dataset(cfg, split="train", vocab_size=259)
    expected = [
        t for doc in itertools.chain(*documents.values()) for t in (257, *doc.encode(), 258)
    ]
    tokens = rows(train).ravel()
    np.testing.assert_array_equal(tokens[: len(expected)], expected)
    assert set(tokens[len(expected) :]) <= {256}
    # Globs and single files name the same documents.
    globbed = text_config(
        paths=[
            str(tmp_path / "data" / "*.jsonl*"),
            str(tmp_path / "data/c.parquet"),
            str(tmp_path / "data/d.md"),
        ]
    )
    np.testing.assert_array_equal(
        rows(build_dataset(globbed, split="train", vocab_size=259)), rows(train)
    )


def test_a_prepared_directory_gives_the_batches_of_its_text(tmp_path):
    from meshtrain.cli.prepare import main as prepare_main

    write_sources(tmp_path / "data")
    prepare_main(["--out", str(tmp_path / "prepared"), str(tmp_path / "data")])
    options = {"seq_len": 8, "validation_fraction": 0.3, "cache_dir": None}
    prepared = DataConfig(source="prepared", path=str(tmp_path / "prepared"), **options)
    text = DataConfig(paths=[str(tmp_path / "data")], **options)
    for split in ("train", "validation"):
        np.testing.assert_array_equal(
            rows(build_dataset(prepared, split=split, vocab_size=259)),
            rows(build_dataset(text, split=split, vocab_size=259)),
        )
    bpe = train_bpe(tmp_path / "bpe")
    with pytest.raises(
        DataError,
        match=r"^data\.tokenizer='.*tokenizer\.json' is not the tokenizer .*prepared with \(ByteTokenizer",
    ) as err:
        build_dataset(
            DataConfig(source="prepared", path=str(tmp_path / "prepared"), tokenizer=str(bpe)),
            split="train",
            vocab_size=384,
        )
    assert "\n" not in str(err.value)


def test_validation_paths_replace_the_fraction(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "held").mkdir()
    for i in range(20):
        (tmp_path / "train" / f"{i}.txt").write_text(f"train {i}")
    (tmp_path / "held" / "v.jsonl").write_text('{"text": "held out"}\n')
    cfg = text_config(
        paths=[str(tmp_path / "train")],
        validation_paths=[str(tmp_path / "held")],
        validation_fraction=0.5,
    )
    train = build_dataset(cfg, split="train", vocab_size=259)
    validation = build_dataset(cfg, split="validation", vocab_size=259)
    assert train.num_documents == 20  # the fraction is not applied: every training document
    assert stream_bytes(validation) == b"held out"


def test_a_mixture_samples_its_sources_by_weight(tmp_path):
    for name, count in (("code", 30), ("prose", 200)):
        (tmp_path / name).mkdir()
        for i in range(count):
            (tmp_path / name / f"{i}.txt").write_text(f"{name:8}")  # a sequence: bos, 8, eos
    cfg = text_config(
        seq_len=9,
        mixture=[
            MixtureSource(name="code", paths=[str(tmp_path / "code")], weight=0.7),
            MixtureSource(name="prose", paths=[str(tmp_path / "prose")], weight=0.3),
        ],
    )
    train = build_dataset(cfg, split="train", vocab_size=259)
    assert isinstance(train, MixedDataset) and train.names == ["code", "prose"]
    it = BatchIterator(train, global_batch=50, accum_steps=1, rows=slice(0, 50), seed=0)
    batches = np.concatenate([next(it)[0] for _ in range(40)])  # 2,000 sequences
    drawn_code = np.mean(batches[:, 1] == ord("c"))
    shares = it.shares(40)  # after 40 steps of 50
    assert abs(shares["code"] - 0.7) < 0.03 and shares["code"] + shares["prose"] == 1.0
    assert abs(drawn_code - shares["code"]) < 0.01


def test_an_emptied_corpus_names_the_skipped_records(tmp_path):
    (tmp_path / "bad.jsonl").write_text('not json\n{"other": 1}\n')
    cfg = text_config(paths=[str(tmp_path / "bad.jsonl")], on_bad_record="skip")
    with pytest.raises(
        DataError,
        match=r"^data source 'text' has no training documents: every document was skipped \(skipped 2 records",
    ) as err:
        build_dataset(cfg, split="train", vocab_size=259)
    assert "\n" not in str(err.value)


def test_reading_ahead_gives_the_same_batches(stdlib_train):
    options = {"global_batch": 8, "accum_steps": 2, "rows": slice(1, 3), "seed": 4}
    plain = BatchIterator(stdlib_train, **options)
    ahead = BatchIterator(stdlib_train, workers=2, **options)
    for step in range(6):
        np.testing.assert_array_equal(next(ahead), next(plain))
        if step == 3:  # a resume moves both; what was read ahead is dropped
            plain.set_state({"step": 10})
            ahead.set_state({"step": 10})
    assert ahead.get_state() == plain.get_state() == {"step": 12, "position": 96}


def test_a_resume_with_another_global_batch_continues_at_the_saved_position():
    ds = ArangeDataset(37)
    eight = BatchIterator(ds, global_batch=8, accum_steps=1, rows=slice(0, 8), seed=3)
    batches = [next(eight) for _ in range(7)]  # positions 0 ... 55
    four = BatchIterator(ds, global_batch=4, accum_steps=1, rows=slice(0, 4), seed=3)
    four.set_state(json.loads(json.dumps({"step": 5, "position": 40})))
    np.testing.assert_array_equal(next(four)[0], batches[5][0][:4])  # positions 40 ... 43
    np.testing.assert_array_equal(next(four)[0], batches[5][0][4:])
    np.testing.assert_array_equal(next(four)[0], batches[6][0][:4])
    assert four.get_state() == {"step": 8, "position": 52}
    older = BatchIterator(ds, global_batch=8, accum_steps=1, rows=slice(0, 8), seed=3)
    older.set_state({"step": 6})  # a checkpoint written before positions were saved
    np.testing.assert_array_equal(next(older), batches[6])
