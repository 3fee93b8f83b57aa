"""Tests of meshtrain.data.sources: finding corpus files and reading their documents, with every
bad record raised as one line naming the file and line/row, or skipped and counted."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshtrain.config import DataConfig
from meshtrain.data import build_dataset
from meshtrain.data.bad_records import BadRecords
from meshtrain.data.parts import split_jsonl, split_parquet
from meshtrain.data.sources import (
    Part,
    document_format,
    list_documents,
    read_documents,
    resolve_paths,
)
from meshtrain.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def stdlib_paths() -> list[Path]:
    return list_documents(None, "**/*.py")


def test_stdlib_documents_are_py_files_outside_site_packages(stdlib_paths):
    assert len(stdlib_paths) > 500
    assert stdlib_paths == sorted(stdlib_paths)
    assert all(p.suffix == ".py" for p in stdlib_paths)
    assert not any("site-packages" in p.parts for p in stdlib_paths)
    assert any(p.name == "os.py" for p in stdlib_paths)


def test_glob_matches_top_level_and_nested(tmp_path):
    (tmp_path / "sub" / "site-packages").mkdir(parents=True)
    for name in ["a.py", "sub/b.py", "sub/c.txt", "sub/site-packages/d.py"]:
        (tmp_path / name).write_text("x")
    rel = [p.relative_to(tmp_path).as_posix() for p in list_documents(str(tmp_path), "**/*.py")]
    assert rel == ["a.py", "sub/b.py"]
    rel = [p.relative_to(tmp_path).as_posix() for p in list_documents(str(tmp_path), "sub/*")]
    assert rel == ["sub/b.py", "sub/c.txt"]
    with pytest.raises(ValueError, match=r"data\.glob='\*\.md' matches no readable file"):
        list_documents(str(tmp_path), "*.md")


def read(path: Path, on_bad_record: str = "error", **kwargs) -> tuple[list, BadRecords]:
    bad = BadRecords()
    docs = list(read_documents(path, on_bad_record=on_bad_record, bad=bad, **kwargs))
    return docs, bad


def one_line_error(path: Path, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        read(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_data_error_is_a_config_error_with_exit_code_2():
    assert issubclass(DataError, ConfigError) and DataError.exit_code == 2


def test_document_format_by_extension():
    names = ["a.jsonl", "a.JSONL.gz", "a.parquet", "a.py", "a.json", "a.gz", "README"]
    formats = [document_format(Path(n)) for n in names]
    assert formats == ["jsonl", "jsonl.gz", "parquet", "text", "text", "text", "text"]


def test_resolve_paths_file_dir_glob_mixed(tmp_path):
    for name in ["a/x.txt", "a/b/y.jsonl", "a/.hidden", "a/__pycache__/z.pyc", "c/w.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("t")
    files, root = resolve_paths([str(tmp_path / "a")])
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a/b/y.jsonl", "a/x.txt"]
    assert root == tmp_path / "a"
    files, root = resolve_paths([str(tmp_path / "c/w.txt")])
    assert files == [tmp_path / "c/w.txt"] and root == tmp_path / "c"
    files, root = resolve_paths(
        [str(tmp_path / "**/*.txt"), str(tmp_path / "a"), str(tmp_path / "c/w.txt")]
    )
    rel = [f.relative_to(tmp_path).as_posix() for f in files]
    assert rel == ["a/b/y.jsonl", "a/x.txt", "c/w.txt"]  # sorted, de-duplicated
    assert root == tmp_path


def test_resolve_paths_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"^data\.paths: '.*nope' does not exist; give a file"):
        resolve_paths([str(tmp_path / "nope")])
    with pytest.raises(DataError, match=r"^data\.paths: '.*\*\.md' matches no file"):
        resolve_paths([str(tmp_path / "*.md")])
    with pytest.raises(DataError, match=r"^PATH: directory '.*empty' holds no files"):
        resolve_paths([str(tmp_path / "empty")], key="PATH")
    with pytest.raises(DataError, match=r"^data\.paths is empty"):
        resolve_paths([])


def test_jsonl_and_gz_records_with_line_numbers(tmp_path):
    lines = ['{"text": "one"}', "", '{"text": "tw\\u00f6", "id": 2}', "  ", '{"text": ""}']
    docs, bad = read(write_jsonl(tmp_path / "a.jsonl", lines))
    assert docs == [(1, "one"), (3, "twö"), (5, "")] and bad.total == 0
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    assert read(tmp_path / "a.jsonl.gz")[0] == docs
    docs, _ = read(write_jsonl(tmp_path / "b.jsonl", ['{"content": "c"}']), text_key="content")
    assert docs == [(1, "c")]


def test_jsonl_byte_ranges_keep_absolute_line_numbers(tmp_path):
    lines = [json.dumps({"text": f"document {i} " + "x" * (i % 7)}) for i in range(50)]
    path = write_jsonl(tmp_path / "big.jsonl", lines)
    parts = split_jsonl(path, 100)
    assert len(parts) > 5 and parts[0].start == 0 and parts[-1].stop == path.stat().st_size
    assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
    data = path.read_bytes()
    assert all(data[p.start - 1 : p.start] == b"\n" for p in parts[1:])  # cut at line starts
    docs = [d for p in parts for d in read(path, part=p)[0]]
    assert docs == read(path)[0] and [n for n, _ in docs] == list(range(1, 51))


def test_text_file_is_one_document(tmp_path):
    (tmp_path / "a.py").write_text("print('hé')\n")
    assert read(tmp_path / "a.py")[0] == [(0, "print('hé')\n")]


def test_an_empty_text_file_is_refused_like_an_empty_jsonl(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert read(tmp_path / "empty.txt") == read(tmp_path / "empty.jsonl") == ([], BadRecords())
    for name in ("empty.txt", "empty.jsonl"):
        cfg = DataConfig(paths=[str(tmp_path / name)], cache_dir=None)
        with pytest.raises(DataError) as info:
            build_dataset(cfg, split="train", vocab_size=384)
        assert str(info.value) == (
            "data source 'text' has no training documents; check its paths and "
            "data.validation_fraction"
        )


def write_parquet(path: Path, texts: list, group: int = 2, name: str = "text") -> Path:
    pq.write_table(
        pa.table({name: texts, "n": list(range(len(texts)))}), path, row_group_size=group
    )
    return path


def test_parquet_is_read_one_row_group_at_a_time(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "a.parquet", [f"doc {i}" for i in range(7)])
    calls = []
    original = pq.ParquetFile.read_row_group

    def recording(self, group, columns=None, **kwargs):
        calls.append((group, columns))
        return original(self, group, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", recording)
    monkeypatch.setattr(pq, "read_table", None)  # never the whole file
    docs, _ = read(path)
    assert docs == [(i, f"doc {i}") for i in range(7)]
    assert calls == [(g, ["text"]) for g in range(4)]
    calls.clear()
    parts = split_parquet(path, 1)
    assert [(p.start, p.stop, p.first_record) for p in parts] == [
        (0, 1, 0),
        (1, 2, 2),
        (2, 3, 4),
        (3, 4, 6),
    ]
    assert read(path, part=parts[2])[0] == [(4, "doc 4"), (5, "doc 5")]
    assert calls == [(2, ["text"])]


def test_bad_json_lines(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ['{"text": "ok"}', "{oops", "[1, 2]", '{"text": "z"}'])
    message = one_line_error(path)
    assert message.startswith(f"{path}:2: invalid JSON (Expecting property name")
    assert message.endswith(
        "set data.on_bad_record=skip (prepare: --on-bad-record skip) to skip it"
    )
    docs, bad = read(path, "skip")
    assert docs == [(1, "ok"), (4, "z")] and bad.counts == {"invalid_json": 2}
    assert bad.describe() == "skipped 2 records: 2 invalid_json"
    path = write_jsonl(tmp_path / "b.jsonl", ["[1, 2]"])
    assert one_line_error(path).startswith(f"{path}:1: a JSON list where one object per line")


def test_missing_and_non_string_text_key(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ['{"id": 1, "content": "c"}', '{"text": 3}'])
    assert one_line_error(path).startswith(
        f"{path}:1: no 'text' key (has keys ['content', 'id']); set data.text_key=content, or "
    )
    path = write_jsonl(tmp_path / "b.jsonl", ['{"text": 3}', '{"text": null}', '{"text": "t"}'])
    assert one_line_error(path).startswith(
        f"{path}:1: 'text' holds int '3', not a string; set data."
    )
    docs, bad = read(path, "skip")
    assert docs == [(3, "t")]
    assert bad.counts == {"non_string_text": 1, "missing_text_key": 1}
    assert bad.describe() == "skipped 2 records: 1 missing_text_key, 1 non_string_text"


def test_parquet_nulls_missing_column_and_corrupt_file(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", ["a", None, "c"])
    assert one_line_error(path).startswith(
        f"{path} row 1 (from 0): 'text' is null; fill it, or set data."
    )
    docs, bad = read(path, "skip")
    assert docs == [(0, "a"), (2, "c")] and bad.counts == {"missing_text_key": 1}
    path = write_parquet(tmp_path / "b.parquet", ["a"], name="body")
    message = f"{path}: no column 'text' (columns: ['body', 'n']); set data.text_key=body"
    assert one_line_error(path) == message
    assert one_line_error(path, on_bad_record="skip") == message  # never skippable
    path = tmp_path / "c.parquet"
    path.write_bytes(b"not a parquet file at all")
    assert one_line_error(path).startswith(f"{path}: unreadable parquet file (")
    docs, bad = read(path, "skip")
    assert docs == [] and bad.counts == {"unreadable_parquet": 1}
    assert split_parquet(path, 10) is None


def test_undecodable_text_names_the_line(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes(b"line one\nline two\ncaf\xe9\n")
    message = one_line_error(path)
    assert message.startswith(f"{path}:3: not UTF-8 text (byte 0xe9); convert the file to UTF-8")
    docs, bad = read(path, "skip")
    assert docs == [] and bad.counts == {"undecodable_bytes": 1}


def test_a_lone_surrogate_is_a_bad_record_named_by_line_and_field(tmp_path):
    # A surrogate pair is one character (😀); a lone half is no text any tokenizer encodes.
    lines = ['{"text": "ok \\ud83d\\ude00"}', '{"text": "bad \\ud800"}', '{"text": "z"}']
    path = write_jsonl(tmp_path / "a.jsonl", lines)
    assert one_line_error(path) == (
        f"{path}:2: text holds a lone surrogate (a \\uD800-\\uDFFF escape without its pair), "
        "which is no Unicode text; fix the line, or set data.on_bad_record=skip (prepare: "
        "--on-bad-record skip) to skip it"
    )
    docs, bad = read(path, "skip")
    assert docs == [(1, "ok \U0001f600"), (3, "z")] and bad.counts == {"lone_surrogate": 1}
    chat = [
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\\uDC00"}]}'
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", chat)
    assert one_line_error(path).startswith(f"{path}:1: messages[1].content holds a lone surrogate")


def test_records_only_passes_over_a_directorys_other_files(tmp_path, caplog):
    # A chat or preference directory with a README beside its records (issue: refused outright).
    data = tmp_path / "chats"
    data.mkdir()
    for name in ("a.jsonl", "b.jsonl.gz", "c.parquet", "README.md", "LICENSE"):
        (data / name).write_text("")
    with caplog.at_level("INFO", logger="meshtrain.data.sources"):
        files, root = resolve_paths([str(data)], records_only=True)
    assert [f.name for f in files] == ["a.jsonl", "b.jsonl.gz", "c.parquet"] and root == data
    assert caplog.messages == [
        f"data.paths: {str(data)!r}: passed over 2 file(s) not of .jsonl, .jsonl.gz or .parquet: "
        "LICENSE, README.md"
    ]
    files, _ = resolve_paths([f"{data}/*"], records_only=True)  # a glob alike
    assert len(files) == 3
    # A file named on its own is taken as it is (reading it then says what it should be).
    files, _ = resolve_paths([str(data / "README.md")], records_only=True)
    assert [f.name for f in files] == ["README.md"]
    assert len(resolve_paths([str(data)])[0]) == 5  # documents: every file is one
    (data / "a.jsonl").unlink(), (data / "b.jsonl.gz").unlink(), (data / "c.parquet").unlink()
    with pytest.raises(DataError, match=r"directory '.*chats' holds no .jsonl, .jsonl.gz or .parq"):
        resolve_paths([str(data)], records_only=True)


def test_bad_on_bad_record_value(tmp_path):
    with pytest.raises(DataError, match=r"data\.on_bad_record='ignore' is not supported"):
        read(write_jsonl(tmp_path / "a.jsonl", []), "ignore")


def test_bad_records_merge_and_total():
    a, b = BadRecords(), BadRecords({"invalid_json": 2})
    a.add("undecodable_bytes")
    a.merge(b)
    assert a.counts == {"undecodable_bytes": 1, "invalid_json": 2} and a.total == 3
    assert BadRecords().describe() == "skipped no records"
    assert Part(0, 10, 1).first_record == 1
