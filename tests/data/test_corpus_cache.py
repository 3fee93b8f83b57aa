"""The data cache of tokenised text sources (data.cache_dir): a second build tokenises nothing,
gives bit-identical batches, and any change to the files or tokenizer makes a new entry."""

import os
from pathlib import Path

import numpy as np
import pytest
from helpers.tiny_tokenizers import train_bpe

from meshtrain.config import DataConfig
from meshtrain.data import BatchIterator, build_dataset, validation_batches
from meshtrain.data import prepare as prepare_module
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
    return sorted(p for p in cache.iterdir() if (p / "manifest.json").is_file())


def no_tokenising(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the documents were tokenised again")

    monkeypatch.setattr(prepare_module, "_run_units", fail)


def rows(dataset) -> np.ndarray:
    return np.stack([dataset[i] for i in range(len(dataset))])


@pytest.mark.parametrize("split", ["train", "validation"])
def test_a_cached_split_is_bit_identical_and_tokenises_nothing(
    corpus, tmp_path, monkeypatch, split
):
    cache = tmp_path / "cache"
    uncached = build_dataset(config(corpus, None), split=split, vocab_size=384)
    assert len(uncached) > 0
    build_dataset(config(corpus, cache), split=split, vocab_size=384)  # tokenises and stores
    assert len(entries(cache)) == 1
    no_tokenising(monkeypatch)
    cached = build_dataset(config(corpus, cache), split=split, vocab_size=384)
    np.testing.assert_array_equal(rows(cached), rows(uncached))
    assert (cached.vocab_size, cached.pad_id, cached.seq_len, cached.num_tokens) == (
        uncached.vocab_size,
        uncached.pad_id,
        uncached.seq_len,
        uncached.num_tokens,
    )
    # One entry serves every seq_len: packing happens as sequences are read.
    longer = build_dataset(config(corpus, cache, seq_len=32), split=split, vocab_size=384)
    assert longer.seq_len == 32 and len(entries(cache)) == 1


def test_batches_from_the_cache_are_the_uncached_batches(corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    build_dataset(config(corpus, cache), split="train", vocab_size=384)
    no_tokenising(monkeypatch)
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


def test_a_changed_document_is_tokenised_again(corpus, tmp_path):
    cache = tmp_path / "cache"
    build_dataset(config(corpus, cache), split="train", vocab_size=384)
    document = corpus / "a.txt"
    document.write_text(TEXTS["a.txt"] + "print('changed')\n")
    stat = document.stat()  # a later modification time, even on a coarse clock
    os.utime(document, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    rebuilt = build_dataset(config(corpus, cache), split="train", vocab_size=384)
    uncached = build_dataset(config(corpus, None), split="train", vocab_size=384)
    np.testing.assert_array_equal(rows(rebuilt), rows(uncached))
    assert len(entries(cache)) == 2  # a new entry; the old one is evicted later
    (corpus / "h.txt").write_text("new = 1\n")  # a new document
    build_dataset(config(corpus, cache), split="train", vocab_size=384)
    assert len(entries(cache)) == 3


def test_the_key_names_the_files_the_tokenizer_and_the_options(corpus, tmp_path):
    files = sorted(corpus.glob("*.txt"))
    options = {"tokenizer": "byte", "text_key": "text", "on_bad_record": "error"}
    byte = corpus_key(files, corpus, **options)
    assert byte == corpus_key(files, corpus, **options)
    assert byte != corpus_key(files[1:], corpus, **options)
    assert byte != corpus_key(files, corpus, **{**options, "text_key": "content"})
    assert byte != corpus_key(files, corpus, **{**options, "on_bad_record": "skip"})
    vocabulary = train_bpe(tmp_path / "tok")
    bpe = corpus_key(files, corpus, **{**options, "tokenizer": str(vocabulary)})
    assert bpe != byte
    # The tokenizer's identity is its content: touching the file changes nothing, editing does.
    stat = vocabulary.stat()
    os.utime(vocabulary, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert bpe == corpus_key(files, corpus, **{**options, "tokenizer": str(vocabulary)})


def test_auto_caches_under_the_cache_root_and_null_caches_nothing(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "root"))
    build_dataset(config(corpus, None, cache_dir="auto"), split="train", vocab_size=384)
    assert len(entries(tmp_path / "root" / "data")) == 1
    build_dataset(config(corpus, None, text_key="other"), split="train", vocab_size=384)
    assert len(entries(tmp_path / "root" / "data")) == 1


def test_the_least_recently_used_entries_go_first(tmp_path):
    for age, name in enumerate(["old", "middle", "new"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
        np.save(tmp_path / name / "tokens.npy", np.zeros(1000, np.int32))
        os.utime(tmp_path / name, (1000 + age, 1000 + age))
    size = sum(f.stat().st_size for f in (tmp_path / "new").iterdir())
    _evict(tmp_path, keep=tmp_path / "old", max_bytes=2 * size)
    assert [p.name for p in entries(tmp_path)] == ["new", "old"]  # kept: the entry in use
    _evict(tmp_path, keep=tmp_path / "old", max_bytes=0)
    assert [p.name for p in entries(tmp_path)] == ["old"]
