"""Finds the files of a corpus and reads their documents: .jsonl, .jsonl.gz, .parquet or one
document per other file, with each bad record raised as one line or skipped and counted."""

from __future__ import annotations

import fnmatch
import glob as globbing
import gzip
import json
import logging
import os
import sysconfig
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain.data.bad_records import ON_BAD_RECORD, SKIP_HINT, BadRecords, fault
from meshtrain.data.parts import Part
from meshtrain.data.unicode import lone_surrogate
from meshtrain.errors import DataError

if TYPE_CHECKING:
    import pyarrow.parquet as pq

FORMATS = ("jsonl", "jsonl.gz", "parquet", "text")
RECORD_FORMATS = ("jsonl", "jsonl.gz", "parquet")  # files of records (chat, preference data)
# Installed third-party packages are not corpus text, and a virtualenv may live under them. With a
# venv, sysconfig's stdlib still points at the base interpreter's lib/pythonX.Y, whose
# site-packages holds that interpreter's packages; Debian's system Python uses dist-packages.
_PRUNED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
log = logging.getLogger(__name__)


def document_format(path: Path) -> str:
    """The format of a file by its name: jsonl, jsonl.gz, parquet, or text (one document)."""
    name = path.name.lower()
    for suffix, fmt in ((".jsonl", "jsonl"), (".jsonl.gz", "jsonl.gz"), (".parquet", "parquet")):
        if name.endswith(suffix):
            return fmt
    return "text"


def resolve_root(path: str | None) -> Path:
    """Returns the corpus directory: `path`, or the standard library's source if None."""
    root = Path(sysconfig.get_paths()["stdlib"] if path is None else path).expanduser()
    if not root.is_dir():
        raise ValueError(
            f"data.path={path!r} is not a directory; point it at a folder of text documents "
            "or set it to null for the Python standard library"
        )
    return root


def _matches(parts: Sequence[str], pattern: Sequence[str]) -> bool:
    """Glob match of path components, where `**` stands for zero or more directories."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return (
        bool(parts)
        and fnmatch.fnmatchcase(parts[0], pattern[0])
        and _matches(parts[1:], pattern[1:])
    )


def list_documents(path: str | None, glob: str) -> list[Path]:
    """Returns the readable files under the corpus root that match `glob`, sorted.

    Walks the tree itself instead of using Path.glob so that site-packages is pruned rather than
    walked and filtered: under a pyenv or system install it can hold ten times the stdlib's files.
    """
    root = resolve_root(path)
    pattern = Path(glob).parts
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _PRUNED_DIRS]
        rel_dir = Path(dirpath).relative_to(root).parts
        for name in filenames:
            file = Path(dirpath, name)
            if _matches((*rel_dir, name), pattern) and file.is_file() and os.access(file, os.R_OK):
                found.append(file)
    if not found:
        raise ValueError(f"data.glob={glob!r} matches no readable file under {str(root)!r}")
    return sorted(found)


def _files_under(directory: Path) -> list[Path]:
    """Every file under `directory`, hidden names and __pycache__/site-packages pruned."""
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if d not in _PRUNED_DIRS and not d.startswith(".")]
        found += [Path(dirpath, n) for n in filenames if not n.startswith(".")]
    return [f for f in found if f.is_file()]


def resolve_paths(
    patterns: Sequence[str],
    *,
    key: str = "data.paths",
    records_only: bool = False,
    quiet: bool = False,
) -> tuple[list[Path], Path]:
    """Returns (the files named by `patterns`, sorted and de-duplicated, their root directory).

    Each pattern is a file, a directory (every file under it) or a glob (`**` for any depth). The
    root is the common directory of the files' parents: document keys are paths relative to it.
    With `records_only` (chat and preference data: records, not documents), a directory or glob
    gives its .jsonl, .jsonl.gz and .parquet files, and the others it holds (a README) are passed
    over with one log line (none when `quiet`); a file named on its own is taken as it is.
    """
    if not patterns:
        raise DataError(f"{key} is empty; give at least one file, directory or glob")
    files: set[Path] = set()
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if globbing.has_magic(expanded):
            matched = [Path(m) for m in globbing.glob(expanded, recursive=True)]
            found = [f for m in matched for f in ([m] if m.is_file() else _files_under(m))]
            found = _record_files(found, pattern, key, quiet) if records_only else found
            if not found:
                raise DataError(
                    f"{key}: {pattern!r} matches no file; check the pattern (** matches any depth)"
                )
        elif Path(expanded).is_dir():
            found = _files_under(Path(expanded))
            found = _record_files(found, pattern, key, quiet) if records_only else found
            if not found:
                held = "no .jsonl, .jsonl.gz or .parquet files" if records_only else "no files"
                raise DataError(f"{key}: directory {pattern!r} holds {held}; add documents to it")
        elif Path(expanded).exists():
            found = [Path(expanded)]
        else:
            raise DataError(
                f"{key}: {pattern!r} does not exist; give a file, a directory or a glob"
            )
        files.update(f.absolute() for f in found)
    ordered = sorted(files)
    return ordered, Path(os.path.commonpath([f.parent for f in ordered]))


def _record_files(found: list[Path], pattern: str, key: str, quiet: bool) -> list[Path]:
    """The record files among `found` (what `pattern` expanded to); the others, logged."""
    kept = [f for f in found if document_format(f) in RECORD_FORMATS]
    if not quiet and (passed := sorted(f.name for f in found if f not in kept)):
        shown = ", ".join(passed[:5]) + (f" and {len(passed) - 5} more" if len(passed) > 5 else "")
        log.info(
            "%s: %r: passed over %d file(s) not of .jsonl, .jsonl.gz or .parquet: %s",
            key,
            pattern,
            len(passed),
            shown,
        )
    return kept


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _record_text(
    record: dict[str, Any], where: str, text_key: str, on_bad_record: str, bad: BadRecords
) -> str | None:
    """The text of one .jsonl record, or None when it has none and is skipped."""
    if text_key not in record or record[text_key] is None:
        strings = [k for k, v in record.items() if isinstance(v, str)] or list(record)
        fix = f"set data.text_key={strings[0]}" if strings else "give each record a text"
        message = f"{where}: no {text_key!r} key (has keys {sorted(record)}); {fix}, or "
        fault("missing_text_key", message + SKIP_HINT, on_bad_record, bad)
        return None
    text = record[text_key]
    if not isinstance(text, str):
        _not_a_string(where, text_key, text, "field", on_bad_record, bad)
        return None
    return text


def _record(line: bytes, where: str, on_bad_record: str, bad: BadRecords) -> dict | None:
    """The JSON object of one .jsonl line, or None when the line is bad and skipped."""
    try:
        record = json.loads(line)
    except UnicodeDecodeError as err:
        message = f"{where}: not UTF-8 ({err.reason}); fix the line, or "
        fault("undecodable_bytes", message + SKIP_HINT, on_bad_record, bad)
        return None
    except json.JSONDecodeError as err:
        message = f"{where}: invalid JSON ({err.msg} at column {err.colno}); fix the line, or "
        fault("invalid_json", message + SKIP_HINT, on_bad_record, bad)
        return None
    if not isinstance(record, dict):
        message = f"{where}: a JSON {type(record).__name__} where one object per line is expected; "
        fault("invalid_json", message + SKIP_HINT, on_bad_record, bad)
        return None
    if at := lone_surrogate(line, record):
        message = (
            f"{where}: {at} holds a lone surrogate (a \\uD800-\\uDFFF escape without its pair), "
            "which is no Unicode text; fix the line, or "
        )
        fault("lone_surrogate", message + SKIP_HINT, on_bad_record, bad)
        return None
    return record


def _not_a_string(
    where: str, text_key: str, value: object, holder: str, on_bad_record: str, bad: BadRecords
) -> None:
    """The fault of a record whose `text_key` (a JSON field or parquet column) is no string."""
    message = (
        f"{where}: {text_key!r} holds {type(value).__name__} {str(value)[:20]!r}, not a "
        f"string; set data.text_key to a text {holder}, or "
    )
    fault("non_string_text", message + SKIP_HINT, on_bad_record, bad)


def _jsonl_lines(path: Path, part: Part | None) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of a .jsonl or .jsonl.gz file, or of one byte range of it."""
    if part is None:
        opener = gzip.open if document_format(path) == "jsonl.gz" else open
        with opener(path, "rb") as f:
            yield from enumerate(f, 1)
        return
    with open(path, "rb") as f:
        f.seek(part.start)
        position, number = part.start, part.first_record
        while position < part.stop:
            line = f.readline()
            if not line:
                return
            yield number, line
            position, number = position + len(line), number + 1


def _jsonl_records(
    path: Path, on_bad_record: str, bad: BadRecords, part: Part | None
) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line number, where, object) of each readable record of a .jsonl or .jsonl.gz file."""
    try:
        for number, line in _jsonl_lines(path, part):
            where = f"{path}:{number}"
            if line.strip() and (record := _record(line, where, on_bad_record, bad)):
                yield number, where, record
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise DataError(
            f"{path}: unreadable gzip file ({_one_line(err)}); re-create or remove it"
        ) from None


def _read_jsonl(path, text_key, on_bad_record, bad, part) -> Iterator[tuple[int, str]]:
    for number, where, record in _jsonl_records(path, on_bad_record, bad, part):
        text = _record_text(record, where, text_key, on_bad_record, bad)
        if text is not None:
            yield number, text


def _parquet_column(file: pq.ParquetFile, path: Path, text_key: str) -> None:
    """Raises (always: no record could be read) if the file has no `text_key` column."""
    names = file.schema_arrow.names
    if text_key not in names:
        fix = f"set data.text_key={names[0]}" if names else "write the text in a column"
        raise DataError(f"{path}: no column {text_key!r} (columns: {names}); {fix}")


def _read_parquet(path, text_key, on_bad_record, bad, part) -> Iterator[tuple[int, str]]:
    """Reads the `text_key` column one row group at a time, never the whole file."""
    import pyarrow as pa  # here: a run without parquet files never loads it
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        _parquet_column(file, path, text_key)
        groups = range(file.num_row_groups) if part is None else range(part.start, part.stop)
        row = 0 if part is None else part.first_record
        for group in groups:
            values = file.read_row_group(group, columns=[text_key]).column(0).to_pylist()
            for offset, text in enumerate(values):
                where = f"{path} row {row + offset} (from 0)"
                if text is None:
                    message = f"{where}: {text_key!r} is null; fill it, or "
                    fault("missing_text_key", message + SKIP_HINT, on_bad_record, bad)
                elif not isinstance(text, str):
                    _not_a_string(where, text_key, text, "column", on_bad_record, bad)
                else:
                    yield row + offset, text
            row += len(values)
    except (pa.ArrowInvalid, OSError) as err:
        message = f"{path}: unreadable parquet file ({_one_line(err)}); re-create or remove it, or "
        fault("unreadable_parquet", message + SKIP_HINT, on_bad_record, bad)


def _read_text(path: Path, on_bad_record: str, bad: BadRecords) -> Iterator[tuple[int, str]]:
    """The one document of a text file; none for an empty file, as for an empty .jsonl."""
    data = path.read_bytes()
    if not data:
        return
    try:
        yield 0, data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        message = (
            f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x}); convert the file "
            "to UTF-8 or remove it, or "
        )
        fault("undecodable_bytes", message + SKIP_HINT, on_bad_record, bad)


def read_documents(
    path: Path,
    *,
    text_key: str = "text",
    on_bad_record: str = "error",
    bad: BadRecords,
    part: Part | None = None,
) -> Iterator[tuple[int, str]]:
    """Yields (record number, text) of each document of `path` (or of its `part`), in file order.

    Record numbers: the 1-based line of a .jsonl/.jsonl.gz, the 0-based row of a parquet file, 0
    for a text file (one document). Blank .jsonl lines and empty files (of any format) hold no
    document; empty texts of records are yielded. A bad record raises a one-line DataError, or
    with on_bad_record="skip" is counted in `bad` and skipped.
    """
    if on_bad_record not in ON_BAD_RECORD:
        raise DataError(
            f"data.on_bad_record={on_bad_record!r} is not supported; use one of {ON_BAD_RECORD}"
        )
    fmt = document_format(path)
    if fmt in ("jsonl", "jsonl.gz"):
        return _read_jsonl(path, text_key, on_bad_record, bad, part)
    if fmt == "parquet":
        return _read_parquet(path, text_key, on_bad_record, bad, part)
    return _read_text(path, on_bad_record, bad)


def read_records[T](
    path: Path,
    convert: Callable[[dict[str, Any]], T],
    *,
    keys: Sequence[str],
    on_bad_record: str = "error",
    bad: BadRecords,
    part: Part | None = None,
) -> Iterator[tuple[int, T]]:
    """Yields (record number, convert(record)) of each record of a .jsonl, .jsonl.gz or .parquet
    file (or of its `part`), in file order, numbered as read_documents does: a record is a jsonl
    line's object, or a parquet row's columns among `keys` (chat data). A record that `convert`
    refuses (a DataError) is a bad record of kind "bad_chat_record", named by file and line or
    row. Other files hold no records: a one-line DataError."""
    fmt = document_format(path)
    if fmt not in RECORD_FORMATS:
        raise DataError(
            f"{path}: chat data are records in .jsonl, .jsonl.gz or .parquet files, not a "
            "text file; convert it, or leave it out of data.paths"
        )
    for number, where, record in _records(path, fmt, keys, on_bad_record, bad, part):
        try:
            converted = convert(record)
        except DataError as err:
            message = f"{where}: {err}; fix the record, or "
            fault("bad_chat_record", message + SKIP_HINT, on_bad_record, bad)
            continue
        yield number, converted


def _records(
    path: Path, fmt: str, keys: Sequence[str], on_bad_record: str, bad: BadRecords, part
) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(number, where, record) of each readable record of a jsonl or parquet file."""
    if fmt != "parquet":
        yield from _jsonl_records(path, on_bad_record, bad, part)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        columns = [k for k in keys if k in file.schema_arrow.names]
        groups = range(file.num_row_groups) if part is None else range(part.start, part.stop)
        row = 0 if part is None else part.first_record
        for group in groups:
            rows = file.read_row_group(group, columns=columns).to_pylist()
            for offset, record in enumerate(rows):
                yield row + offset, f"{path} row {row + offset} (from 0)", record
            row += len(rows)
    except (pa.ArrowInvalid, OSError) as err:
        message = f"{path}: unreadable parquet file ({_one_line(err)}); re-create or remove it, or "
        fault("unreadable_parquet", message + SKIP_HINT, on_bad_record, bad)
