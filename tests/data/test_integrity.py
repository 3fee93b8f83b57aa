"""A damaged prepared directory stops the run when it is opened, in one line that names the
file, what is wrong and the fix (meshtrain.data.integrity), before anything compiles; token
ids beyond the model's vocabulary are that line too, never a NaN loss."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.config import compose_config
from helpers.paths import REPO

from meshtrain.config import DataConfig
from meshtrain.config.data import DataVerify
from meshtrain.config.schema import choices
from meshtrain.config.validate import check_config
from meshtrain.data import build_dataset
from meshtrain.data.integrity import VERIFY_MODES, sample_offsets
from meshtrain.data.prepare import prepare
from meshtrain.data.shards import PreparedCorpus, read_json, write_json, write_unit
from meshtrain.errors import ConfigError, DataError, error_line

FIX = "prepare the corpus again into an empty directory"
BIG = "def alpha(x):\n    return x * 2\n" * 1_300  # 40,300 bytes: 80 KB of uint16 tokens


def make_prepared(directory: Path) -> Path:
    """A prepared directory `directory`/out of two units: a.txt alone (sampled by the quick
    checksum), then a .jsonl of three records and a small text file (hashed whole)."""
    root = directory / "in"
    root.mkdir(parents=True)
    (root / "a.txt").write_text(BIG)
    records = ["hello world", "zebra", "import os"]
    (root / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in records))
    (root / "c.txt").write_text("print('hi')\n")
    prepare(sorted(root.iterdir()), directory / "out", root=root, unit_bytes=30_000)
    return directory / "out"


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    return make_prepared(tmp_path)


def unit_file(directory: Path, index: int, kind: str = "tokens") -> Path:
    return directory / f"unit-{index:05d}.{kind}.npy"


def open_error(directory: Path, vocab_size: int = 384, **changes) -> str:
    """The one line a run on `directory` stops with, from build_dataset (before any compile)."""
    cfg = DataConfig(source="prepared", path=str(directory), validation_fraction=0.0, **changes)
    with pytest.raises(DataError) as err:
        build_dataset(cfg, split="train", vocab_size=vocab_size)
    assert "\n" not in str(err.value)
    return str(err.value)


def header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def unsampled_token(path: Path) -> int:
    """Byte offset of a token near the middle of `path` that the quick checksum does not read."""
    size, start = path.stat().st_size, header_bytes(path)
    blocks = sample_offsets(size)
    assert len(blocks) > 1, "the file must be larger than the quick checksum's blocks"
    for offset in range(start + (size - start) // 2 // 2 * 2, size, 2):
        if all(not (o <= offset < o + n or o <= offset + 1 < o + n) for o, n in blocks):
            return offset
    raise AssertionError("every token is sampled")


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_the_verify_choices_are_the_implemented_ones():
    assert choices(DataVerify) == VERIFY_MODES == ("quick", "full")
    with pytest.raises(ConfigError) as err:
        check_config(compose_config("data.verify=fast"))
    assert str(err.value) == "data.verify='fast' is not supported; use one of: quick, full"


def test_the_manifest_records_checksums_and_the_largest_id(prepared):
    units = read_json(prepared / "manifest.json")["units"]
    assert [u["max_token_id"] for u in units] == [max(BIG.encode()), ord("z")]
    assert all(len(u[k]) == 64 for u in units for k in ("tokens_sha256", "docs_sha256"))
    assert units[0]["tokens_sample_sha256"] != units[0]["tokens_sha256"]  # sampled: 80 KB
    assert units[1]["tokens_sample_sha256"] != units[1]["tokens_sha256"]  # whole, size first


def test_a_truncated_tokens_file(prepared):
    path = unit_file(prepared, 0)
    size = path.stat().st_size
    os.truncate(path, size - 10)
    assert open_error(prepared) == (
        f"{path}: {size - 10} bytes, not the {size} that manifest.json gives (truncated or "
        f"overwritten); {FIX}"
    )


def test_a_removed_tokens_file(prepared):
    path = unit_file(prepared, 1)
    path.unlink()
    assert open_error(prepared) == f"{path}: missing, though manifest.json lists it; {FIX}"


@pytest.mark.parametrize("offset", [0, 10, 30], ids=["magic", "dict-start", "dict-middle"])
def test_seven_bytes_of_a_header_overwritten(prepared, offset):
    path = unit_file(prepared, 0)
    patch(path, offset, b"\x00garble")
    assert open_error(prepared) == f"{path}: its .npy header is unreadable; {FIX}"


def in_header(path: Path, old: bytes, new: bytes) -> None:
    """Replaces `old` by `new` (as long) in the .npy header of `path`."""
    patch(path, path.read_bytes()[: header_bytes(path)].index(old), new)


def test_a_header_of_another_dtype(prepared):
    path = unit_file(prepared, 0)
    in_header(path, b"<u2", b"<u4")
    assert open_error(prepared) == (
        f"{path}: holds uint32 [40300], not the uint16 [40300] that manifest.json lists; {FIX}"
    )


def test_a_truncated_document_table(prepared):
    path = unit_file(prepared, 1, "docs")
    size = path.stat().st_size
    os.truncate(path, size - 16)
    assert open_error(prepared) == (
        f"{path}: {size - 16} bytes, not the {size} that manifest.json gives (truncated or "
        f"overwritten); {FIX}"
    )


def test_a_changed_small_file_fails_the_quick_checksum(prepared):
    path = unit_file(prepared, 1)  # hashed whole: smaller than the sampled blocks
    patch(path, path.stat().st_size - 1, b"\x01")
    message = "its content does not match its checksum in manifest.json (damaged since prepared)"
    assert open_error(prepared) == f"{path}: {message}; {FIX}"


def test_full_verification_finds_a_byte_the_quick_check_does_not_read(prepared):
    path = unit_file(prepared, 0)
    offset = unsampled_token(path)
    patch(path, offset, bytes([path.read_bytes()[offset] ^ 1]))  # still an id below 256
    PreparedCorpus(prepared)  # quick: the byte is between the sampled blocks
    message = "its content does not match its checksum in manifest.json (damaged since prepared)"
    assert open_error(prepared, verify="full") == f"{path}: {message}; {FIX}"


def write_ids_beyond_the_vocabulary(directory: Path) -> None:
    """Makes unit 1 hold id 300, its files and checksums agreeing: as a tokenizer that wrote ids
    beyond its vocabulary would have."""
    stats = read_json(directory / "unit-00001.json")
    ids = [np.array([104, 300, 7]), np.array([5]), np.array([9, 9])]
    hashes = np.load(unit_file(directory, 1, "docs"))[:3, 1].tolist()
    stats.update(documents=3, tokens=6)
    stats = write_unit(directory, 1, ids, hashes, np.dtype(np.uint16), stats)
    manifest = read_json(directory / "manifest.json")
    manifest["units"][1] = {k: v for k, v in stats.items() if k not in ("files", "bad_records")}
    write_json(directory / "manifest.json", manifest)


def test_ids_beyond_the_model_vocabulary_stop_at_open(prepared):
    write_ids_beyond_the_vocabulary(prepared)
    assert open_error(prepared, vocab_size=259) == (
        f"{unit_file(prepared, 1)}: token ids up to 300, not all below model.vocab_size=259; "
        "raise model.vocab_size to 301 or more, or prepare the corpus with the tokenizer of "
        "the model"
    )
    with pytest.raises(DataError) as err:
        PreparedCorpus(prepared).check_vocab(100)  # a.txt's x is 120
    assert str(err.value).startswith(
        f"{unit_file(prepared, 0)}: token ids up to 120, not all below model.vocab_size=100; "
    )


def test_an_id_beyond_the_vocabulary_that_the_quick_check_missed_stops_the_read(prepared):
    path = unit_file(prepared, 0)
    offset = unsampled_token(path)
    patch(path, offset + 1, b"\xff")  # the high byte: an id >= 65280
    cfg = DataConfig(source="prepared", path=str(prepared), validation_fraction=0.0, seq_len=64)
    dataset = build_dataset(cfg, split="train", vocab_size=384)  # opens: not a byte it reads
    token = (offset - header_bytes(path)) // 2
    window = (token + 1) // 65  # a.txt is document 0, after its bos
    for index in range(len(dataset)):
        if index != window:
            dataset[index]
    with pytest.raises(DataError) as err:
        dataset[window]
    high = 0xFF00 | path.read_bytes()[offset]
    assert str(err.value) == (
        f"{path}: token id {high} in document 0 is not below model.vocab_size=384 (the file is "
        f"damaged); {FIX}"
    )


def test_a_file_truncated_after_opening_is_one_line_when_read(prepared):
    corpus = PreparedCorpus(prepared)
    path = unit_file(prepared, 0)
    os.truncate(path, header_bytes(path) + 100)
    with pytest.raises(DataError) as err:
        corpus.read(0, 0, 200)
    assert str(err.value) == f"{path}: truncated after it was opened; {FIX}"


def test_a_manifest_that_is_not_json(prepared):
    (prepared / "manifest.json").write_text('{"version": 1, "units": [')
    assert open_error(prepared) == f"{prepared / 'manifest.json'}: not valid JSON; {FIX}"


def test_a_manifest_without_checksums_is_still_checked(prepared):
    manifest = read_json(prepared / "manifest.json")
    for unit in manifest["units"]:
        for key in ("tokens_sha256", "tokens_sample_sha256", "docs_sha256", "max_token_id"):
            del unit[key]
    write_json(prepared / "manifest.json", manifest)
    path = unit_file(prepared, 0)
    patch(path, unsampled_token(path) + 1, b"\xff")
    corpus = PreparedCorpus(prepared)  # nothing recorded to compare with
    assert corpus.max_token_ids == [None, None]
    assert PreparedCorpus(prepared, verify="full").max_token_ids[0] >= 0xFF00  # every id read
    os.truncate(path, path.stat().st_size - 2)
    assert open_error(prepared).startswith(f"{path}: {path.stat().st_size} bytes, not the ")


def test_a_damaged_cache_entry_is_deleted_and_tokenised_again(tmp_path, caplog):
    root = tmp_path / "in"
    root.mkdir()
    for name, text in {"a.txt": "alpha beta\n" * 40, "b.txt": "gamma\n" * 9}.items():
        (root / name).write_text(text)
    cache = tmp_path / "cache"
    cfg = DataConfig(paths=[str(root)], cache_dir=str(cache), validation_fraction=0.0, seq_len=8)
    before = build_dataset(cfg, split="train", vocab_size=384)
    expected = np.stack([before[i] for i in range(len(before))])
    (entry,) = cache.iterdir()
    path = unit_file(entry, 0)
    size = path.stat().st_size
    os.truncate(path, size - 4)
    with caplog.at_level(logging.INFO, logger="meshtrain.data.corpus_cache"):
        after = build_dataset(cfg, split="train", vocab_size=384)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"data: {path}: {size - 4} bytes, not the {size} that manifest.json gives (truncated or "
        "overwritten); deleted this cache entry to tokenise again"
    ]
    assert path.stat().st_size == size and sorted(cache.iterdir()) == [entry]
    np.testing.assert_array_equal(np.stack([after[i] for i in range(len(after))]), expected)
    os.truncate(path, header_bytes(path) + 2)  # after opening: the error says what to delete
    with pytest.raises(DataError) as err:
        after[0]
    assert str(err.value) == (
        f"{path}: truncated after it was opened; delete {entry}: the data cache tokenises its "
        "files again at the next launch"
    )


def raised(action: Callable[[], Any]) -> str:
    """The one-line DataError `action` raises."""
    with pytest.raises(DataError) as err:
        action()
    assert "\n" not in str(err.value)
    return str(err.value)


def reading(directory: Path, change: Callable[[Path], Any] = lambda d: None) -> str:
    """The error of reading every sequence of `directory`, opened before `change` is done."""
    cfg = DataConfig(source="prepared", path=str(directory), validation_fraction=0.0)
    dataset = build_dataset(cfg, split="train", vocab_size=384)
    change(directory)
    return raised(lambda: [dataset[i] for i in range(len(dataset))])


def high_byte(directory: Path) -> None:
    path = unit_file(directory, 0)
    patch(path, unsampled_token(path) + 1, b"\xff")


def old_manifest_with_a_wrong_length(directory: Path) -> None:
    manifest = read_json(directory / "manifest.json")
    del manifest["units"][1]["docs_sha256"]
    write_json(directory / "manifest.json", manifest)
    table = np.load(unit_file(directory, 1, "docs"))
    table[0, 0] += 1
    np.save(unit_file(directory, 1, "docs"), table)


def tokens(index: int) -> Callable[[Path], Path]:
    return lambda directory: unit_file(directory, index)


def shorten(file: Callable[[Path], Path], by: int) -> Callable[[Path], None]:
    return lambda d: os.truncate(file(d), file(d).stat().st_size - by)


DOCUMENTED: list[tuple[Callable[[Path], Any], Callable[[Path], str]]] = [
    (lambda d: tokens(1)(d).unlink(), open_error),
    (shorten(tokens(0), 10), open_error),
    (lambda d: patch(tokens(0)(d), 10, b"\x00garble"), open_error),
    (lambda d: in_header(tokens(0)(d), b"<u2", b"<u4"), open_error),
    (lambda d: in_header(tokens(0)(d), b"False", b"True "), open_error),  # fortran_order
    (shorten(lambda d: unit_file(d, 1, "docs"), 16), open_error),
    (lambda d: patch(tokens(1)(d), tokens(1)(d).stat().st_size - 1, b"\x01"), open_error),
    (old_manifest_with_a_wrong_length, open_error),
    (lambda d: (d / "manifest.json").write_text("{"), open_error),
    (write_ids_beyond_the_vocabulary, lambda d: open_error(d, vocab_size=259)),
    (high_byte, reading),
    (lambda d: None, lambda d: reading(d, shorten(tokens(0), 100))),
    (lambda d: None, lambda d: reading(d, lambda d: tokens(0)(d).unlink())),
]


def documented(heading: str) -> list[str]:
    section = (REPO / "docs" / "data.md").read_text().split(heading, 1)[1]
    return re.search(r"```text\n(.*?)```", section, re.S).group(1).splitlines()


def test_the_docs_list_every_line_word_for_word(tmp_path):
    printed = []
    for number, (damage, run) in enumerate(DOCUMENTED):
        directory = make_prepared(tmp_path / str(number))
        damage(directory)
        printed.append(error_line(run(directory).replace(str(directory), "/data/prepared")))
    with pytest.raises(ConfigError) as err:
        check_config(compose_config("data.verify=slow"))
    printed.append(error_line(str(err.value)))
    assert printed == documented("### A damaged directory stops the run")
