"""Tests of meshtrain.data.shards: document keys and draws, the prepared-directory reader and
its tokenizer check."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.tiny_tokenizers import train_bpe

from meshtrain.data.prepare import prepare
from meshtrain.data.shards import (
    PreparedCorpus,
    document_draw,
    key_hash,
    token_dtype,
    tokenizer_identity,
)
from meshtrain.data.sources import list_documents, resolve_root
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import DataError

TEXTS = ["hello world", "", "def f(x):\n    return x * 2\n", "ünïcödé ✓"]


def write_corpus(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS)
    (directory / "docs.jsonl").write_text(lines)
    (directory / "sub").mkdir(exist_ok=True)
    (directory / "sub" / "page.txt").write_text("a text file\n")
    return [directory / "docs.jsonl", directory / "sub" / "page.txt"]


def test_key_hash_and_draw_formula():
    assert key_hash("os.py") == 10117537106131081177
    assert document_draw("os.py") == 0.5484727855335011
    assert document_draw("data/a.jsonl:3") == 0.5201123345294176
    digest = hashlib.sha256(b"x/y.jsonl:7").digest()
    assert document_draw("x/y.jsonl:7") == int.from_bytes(digest[:8], "little") / 2**64


def test_uint64_to_float_draws_round_like_python():
    hashes = [2**64 - 1, 2**64 - 2**10, 2**63 + 1, 2**53 + 1, 2**64 - 2**11 + 1, 0, 1]
    draws = np.array(hashes, np.uint64).astype(np.float64) / 2**64
    assert draws.tolist() == [h / 2**64 for h in hashes]


def test_token_dtype_by_vocab():
    assert token_dtype(259) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(151_936) == np.uint32


def test_read_round_trips_every_document(tmp_path):
    files = write_corpus(tmp_path / "in")
    corpus = prepare(files, tmp_path / "out", root=tmp_path / "in")
    expected = [t.encode() for t in TEXTS] + [b"a text file\n"]
    assert corpus.num_documents == 5 and corpus.num_tokens == sum(map(len, expected))
    assert corpus.lengths.dtype == np.int64 and corpus.draws.dtype == np.float64
    assert corpus.lengths.tolist() == [len(e) for e in expected]
    for document, data in enumerate(expected):
        tokens = corpus.read(document, 0, len(data))
        assert (
            tokens.dtype == np.int32
            and tokens.tobytes() == np.frombuffer(data, np.uint8).astype(np.int32).tobytes()
        )
    np.testing.assert_array_equal(corpus.read(2, 4, 9), list(b"f(x):"))
    keys = [f"docs.jsonl:{i}" for i in range(1, 5)] + ["sub/page.txt"]
    assert corpus.draws.tolist() == [document_draw(k) for k in keys]
    with pytest.raises(IndexError, match=r"tokens 0:12 of document 0 \(length 11\)"):
        corpus.read(0, 0, 12)


def test_bpe_tokens_round_trip_and_tokenizer_check(tmp_path):
    files = write_corpus(tmp_path / "in")
    bpe = str(train_bpe(tmp_path / "bpe"))
    corpus = prepare(files, tmp_path / "out", root=tmp_path / "in", tokenizer=bpe)
    tokenizer = build_tokenizer(bpe)
    for document, text in enumerate(TEXTS):
        ids = tokenizer.encode(text)
        np.testing.assert_array_equal(corpus.read(document, 0, len(ids)), ids)
    assert corpus.manifest["token_dtype"] == "uint16"
    # The identity is the content, not the path: a copy elsewhere is the same tokenizer.
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(bpe, moved / "tokenizer.json")
    corpus.check_tokenizer(str(moved / "tokenizer.json"))
    assert tokenizer_identity(str(moved)) == corpus.manifest["tokenizer"]
    with pytest.raises(DataError) as info:
        corpus.check_tokenizer("byte")
    assert str(info.value) == (
        f"data.tokenizer='byte' is not the tokenizer {tmp_path / 'out'} was prepared with "
        f"(HFTokenizer, vocab_size 300, from {bpe!r}); set data.tokenizer={bpe}, or prepare "
        "again with --tokenizer byte into another --out"
    )


def test_tokenizer_identity_of_byte():
    assert tokenizer_identity("byte") == {
        "kind": "ByteTokenizer",
        "vocab_size": 259,
        "bos_id": 257,
        "eos_id": 258,
        "pad_id": 256,
        "sources": [],
    }


def test_not_a_prepared_directory(tmp_path):
    with pytest.raises(DataError) as info:
        PreparedCorpus(tmp_path)
    assert str(info.value) == (
        f"{tmp_path} is not a prepared directory (no manifest.json); make one with python -m "
        f"meshtrain.data.prepare --out {tmp_path} PATH..."
    )


def test_stdlib_draws_keep_the_old_split(tmp_path):
    files, root = list_documents(None, "**/*.py"), resolve_root(None)
    corpus = prepare(files, tmp_path / "std", root=root, on_bad_record="skip")
    prepared = [f for f in corpus.manifest["files"] if f["documents"] == 1]
    empty = [f for f in files if f.stat().st_size == 0]  # an empty file holds no document
    assert len(empty) < 100
    assert corpus.num_documents == len(prepared) > len(files) - len(empty) - 10  # not UTF-8
    skipped = len(files) - len(empty) - len(prepared)
    assert corpus.bad_records.counts == {"undecodable_bytes": skipped}
    old = [
        int.from_bytes(hashlib.sha256(f["path"].encode()).digest()[:8], "little") / 2**64
        for f in prepared
    ]
    assert corpus.draws.tolist() == old
