"""The cache of packed text_files sequences (data.cache_dir): a second build reads no document,
gives bit-identical batches, and any change to the files, tokenizer or seq_len makes a new entry."""

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from meshtrain.config import DataConfig
from meshtrain.data import BatchIterator, ByteTokenizer, build_dataset, pipeline, validation_batches
from meshtrain.data.corpus_cache import _evict, corpus_key

TEXTS = {
    "a.txt": "def alpha():\n    return 1\n" * 7,
    "b.txt": "import os\nprint(os.getcwd())\n" * 3,
    "c/d.txt": "class Delta:\n    pass\n" * 11,
    "c/e.txt": "x = [i * i for i in range(10)]\n" * 5,
    "f.txt": "# a comment\n",
    "g.txt": "while True:\n    break\n" * 9,
}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def config(corpus: Path, cache: Path | None, **changes) -> DataConfig:
    values = {
        "path": str(corpus),
        "glob": "**/*.txt",
        "seq_len": 16,
        "validation_fraction": 0.3,
        "cache_dir": None if cache is None else str(cache),
    }
    return DataConfig(**{**values, **changes})


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.npy"))


def no_reading(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the documents were read again")

    monkeypatch.setattr(pipeline, "read_tokens", fail)


@pytest.mark.parametrize("split", ["train", "validation"])
def test_a_cached_split_is_bit_identical_and_reads_no_document(
    corpus, tmp_path, monkeypatch, split
):
    cache = tmp_path / "cache"
    uncached = build_dataset(config(corpus, None), split=split, vocab_size=384)
    assert len(uncached) > 0
    build_dataset(config(corpus, cache), split=split, vocab_size=384)  # packs and stores
    assert len(entries(cache)) == 1
    no_reading(monkeypatch)
    cached = build_dataset(config(corpus, cache), split=split, vocab_size=384)
    assert isinstance(cached.sequences, np.memmap)  # mapped from the entry, not re-packed
    assert cached.sequences.dtype == uncached.sequences.dtype == np.int32
    assert np.array_equal(cached.sequences, uncached.sequences)
    assert (cached.vocab_size, cached.pad_id, cached.seq_len, cached.num_tokens) == (
        uncached.vocab_size,
        uncached.pad_id,
        uncached.seq_len,
        uncached.num_tokens,
    )


def test_batches_from_the_cache_are_the_uncached_batches(corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    build_dataset(config(corpus, cache), split="train", vocab_size=384)
    no_reading(monkeypatch)
    cached = build_dataset(config(corpus, cache), split="train", vocab_size=384)
    monkeypatch.undo()
    uncached = build_dataset(config(corpus, None), split="train", vocab_size=384)
    options = {"global_batch": 4, "accum_steps": 2, "rows": slice(0, 2), "seed": 3}
    a, b = BatchIterator(cached, **options), BatchIterator(uncached, **options)
    for _ in range(2 * len(uncached)):  # more than an epoch
        batch, expected = next(a), next(b)
        assert batch.dtype == expected.dtype and np.array_equal(batch, expected)
    options = {"global_batch": 3, "num_batches": 2, "rows": slice(0, 3)}
    for batch, expected in zip(
        validation_batches(cached, **options), validation_batches(uncached, **options), strict=True
    ):
        assert np.array_equal(batch, expected)


def test_a_changed_document_is_read_again(corpus, tmp_path):
    cache = tmp_path / "cache"
    build_dataset(config(corpus, cache), split="train", vocab_size=384)
    document = corpus / "a.txt"
    document.write_text(TEXTS["a.txt"] + "print('changed')\n")
    stat = document.stat()  # a later modification time, even on a coarse clock
    os.utime(document, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    rebuilt = build_dataset(config(corpus, cache), split="train", vocab_size=384)
    uncached = build_dataset(config(corpus, None), split="train", vocab_size=384)
    assert np.array_equal(rebuilt.sequences, uncached.sequences)
    assert len(entries(cache)) == 2  # a new entry; the old one is evicted later
    (corpus / "h.txt").write_text("new = 1\n")  # a new document
    build_dataset(config(corpus, cache), split="train", vocab_size=384)
    build_dataset(config(corpus, cache), split="validation", vocab_size=384)
    assert len(entries(cache)) >= 3


def test_each_seq_len_has_its_own_entry(corpus, tmp_path):
    cache = tmp_path / "cache"
    short = build_dataset(config(corpus, cache), split="train", vocab_size=384)
    long = build_dataset(config(corpus, cache, seq_len=32), split="train", vocab_size=384)
    assert (short.seq_len, long.seq_len) == (16, 32)
    assert len(entries(cache)) == 2


def test_the_key_names_the_tokenizer_and_its_files(corpus, tmp_path):
    documents = sorted(corpus.glob("*.txt"))
    byte = corpus_key(documents, ByteTokenizer(), 16)
    assert byte == corpus_key(documents, ByteTokenizer(), 16)
    assert byte != corpus_key(documents, ByteTokenizer(), 17)
    assert byte != corpus_key(documents[1:], ByteTokenizer(), 16)
    vocabulary = tmp_path / "tokenizer.json"
    vocabulary.write_text("{}")

    def tokenizer(eos_id: int = 2) -> SimpleNamespace:
        return SimpleNamespace(
            vocab_size=300, bos_id=1, eos_id=eos_id, pad_id=0, source_files=(vocabulary,)
        )

    file_based = corpus_key(documents, tokenizer(), 16)
    assert file_based != byte
    assert file_based != corpus_key(documents, tokenizer(eos_id=3), 16)
    stat = vocabulary.stat()
    os.utime(vocabulary, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new vocabulary
    assert file_based != corpus_key(documents, tokenizer(), 16)


def test_auto_caches_under_the_cache_root_and_null_caches_nothing(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "root"))
    build_dataset(config(corpus, None, cache_dir="auto"), split="train", vocab_size=384)
    assert len(entries(tmp_path / "root" / "data")) == 1
    build_dataset(config(corpus, None, seq_len=8), split="train", vocab_size=384)
    assert len(entries(tmp_path / "root" / "data")) == 1


def test_the_least_recently_used_entries_go_first(tmp_path):
    for age, name in enumerate(["old", "middle", "new"]):
        np.save(tmp_path / f"{name}.npy", np.zeros(1000, np.int32))
        os.utime(tmp_path / f"{name}.npy", (1000 + age, 1000 + age))
    size = (tmp_path / "new.npy").stat().st_size
    _evict(tmp_path, keep=tmp_path / "old.npy", max_bytes=2 * size)
    assert [p.stem for p in entries(tmp_path)] == ["new", "old"]  # kept: the newest entry
    _evict(tmp_path, keep=tmp_path / "old.npy", max_bytes=0)
    assert [p.stem for p in entries(tmp_path)] == ["old"]
