"""The prepared directory: every document's token ids in work-unit files, written atomically,
and the reader that reads exactly the tokens asked for (meshtrain.data.prepare writes it).

Layout of a prepared directory (FORMAT_VERSION 1):
  plan.json               written first: the inputs (relpath, size, mtime_ns, format), tokenizer
                          identity, options and the work units; a rerun with the same plan resumes
  unit-NNNNN.tokens.npy   uint16 (vocab_size <= 65536) or uint32 [unit tokens]: the unit's
                          documents' ids, no specials, one document after another
  unit-NNNNN.docs.npy     uint64 [unit documents, 2]: (token count, key hash) per document
  unit-NNNNN.json         written last for a unit: its counts per file, bad records, the
                          checksums of its two files and its largest token id (the marker
                          that the unit is done)
  manifest.json           written last of all: plan, per-file and total counts, bad records,
                          and per unit its counts, checksums and largest token id (the checks
                          of meshtrain.data.integrity, run whenever the directory is opened;
                          a manifest from before the checksums gets every other check)
A document's key is its path relative to the root (a text file) or f"{relpath}:{record}"; the
key hash is the first 8 bytes of its sha256, little-endian, and its draw is hash / 2**64.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from meshtrain.data.bad_records import BadRecords
from meshtrain.data.chat.marks import ID_BITS
from meshtrain.data.integrity import (
    MANIFEST,
    REPREPARE,
    VERIFY_MODES,
    DamagedCorpus,
    check_tokens,
    read_docs,
    unit_checks,
)
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import DataError

FORMAT_VERSION = 1
PLAN = "plan.json"
TEMP_PREFIX = ".tmp-"  # partial files of an interrupted write; removed on resume
MAX_OPEN_UNITS = 256  # token files held open at once (each holds a file descriptor)


def unit_name(index: int) -> str:
    return f"unit-{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits in it, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def key_hash(key: str) -> int:
    """The document key's 64-bit hash: the first 8 bytes of sha256(key), little-endian."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def document_draw(key: str) -> float:
    """The document's draw, uniform in [0, 1); the trainer validates on draw < fraction."""
    return key_hash(key) / 2**64


def _file_sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    """The content hash of one version (size, modification time) of a file, computed once."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_identity(tokenizer_name: str) -> dict[str, Any]:
    """What makes token ids mean the same: kind, vocab_size, special ids and the sha256 of each
    source file's content (not its path, so a prepared directory can move between machines)."""
    tokenizer = build_tokenizer(tokenizer_name)
    return {
        "kind": type(tokenizer).__name__,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "sources": [{"name": p.name, "sha256": _file_sha256(p)} for p in tokenizer.source_files],
    }


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Writes `path` through a temporary name and a rename, so it is whole or absent."""
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}")
    with open(temp, "wb") as f:
        write(f)
    os.replace(temp, path)


def write_json(path: Path, value: Any) -> None:
    """Atomically writes `value` as sorted, indented JSON (the same value, the same bytes)."""
    text = json.dumps(value, indent=1, sort_keys=True) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def write_unit(
    directory: Path,
    index: int,
    tokens: list[np.ndarray],
    hashes: list[int],
    dtype: np.dtype,
    stats: dict[str, Any],
) -> dict[str, Any]:
    """Writes one unit: its documents' tokens (each int [length]) concatenated as `dtype`, their
    (length, key hash) table, then the unit's `stats` JSON with the files' checksums and its
    largest token id (meshtrain.data.integrity.unit_checks), the marker that it is complete.
    Returns that JSON's content."""
    lengths = np.fromiter((len(t) for t in tokens), np.uint64, len(tokens))
    flat = np.concatenate(tokens).astype(dtype) if tokens else np.zeros(0, dtype)
    table = np.stack([lengths, np.array(hashes, np.uint64).reshape(-1)], axis=1)
    name = unit_name(index)
    tokens_path, docs_path = directory / f"{name}.tokens.npy", directory / f"{name}.docs.npy"
    write_atomic(tokens_path, lambda f: np.save(f, flat))
    write_atomic(docs_path, lambda f: np.save(f, table))
    stats = {**stats, **unit_checks(tokens_path, docs_path, flat)}
    write_json(directory / f"{name}.json", stats)
    return stats


def _read_manifest(directory: Path, remedy: str) -> dict[str, Any]:
    """The manifest of a prepared directory, checked to be one of FORMAT_VERSION."""
    path = directory / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{directory} is not a prepared directory (no {MANIFEST}); make one with "
            f"python -m meshtrain.data.prepare --out {directory} PATH..."
        )
    try:
        manifest = read_json(path)
    except (ValueError, UnicodeDecodeError):  # json.JSONDecodeError is a ValueError
        raise DamagedCorpus(path, "not valid JSON", remedy) from None
    if not isinstance(manifest, dict) or manifest.get("version") != FORMAT_VERSION:
        version = manifest.get("version") if isinstance(manifest, dict) else None
        raise DataError(
            f"{path}: format version {version!r} is not {FORMAT_VERSION}; prepare it again "
            "into an empty directory"
        )
    return manifest


class PreparedCorpus:
    """A complete prepared directory: per-document lengths and draws in memory (24 bytes per
    document with the offsets), token ids read from disk as they are asked for.

    Opening it checks every unit's files against the manifest (meshtrain.data.integrity):
    `verify` "quick" (sizes, headers, sampled checksums) or "full" (every byte and token id).
    A damaged file raises a one-line DamagedCorpus that names it and ends with `remedy`.
    """

    def __init__(self, directory: Path, *, verify: str = "quick", remedy: str = REPREPARE):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r} is not one of {VERIFY_MODES}")
        self.directory, self.remedy = Path(directory), remedy
        self.manifest: dict[str, Any] = _read_manifest(self.directory, remedy)
        self._dtype = np.dtype(self.manifest["token_dtype"])
        units = self.manifest["units"]
        self._offsets: list[int] = []  # where each unit's token file's data starts
        self.max_token_ids: list[int | None] = []  # each unit's largest id (None: unknown)
        tables = []
        for u in units:
            path = self.directory / f"{u['name']}.tokens.npy"
            offset, largest = check_tokens(
                path, u, self._dtype, full=verify == "full", remedy=remedy
            )
            self._offsets.append(offset)
            self.max_token_ids.append(largest)
            tables.append(read_docs(self.directory / f"{u['name']}.docs.npy", u, remedy))
        table = np.concatenate(tables) if tables else np.zeros((0, 2), np.uint64)
        self.lengths: np.ndarray = table[:, 0].astype(np.int64)  # [num_documents]
        self.draws: np.ndarray = table[:, 1].astype(np.float64) / 2**64  # [num_documents]
        self._starts = np.zeros(len(table) + 1, np.int64)  # token offset of each document
        np.cumsum(self.lengths, out=self._starts[1:])
        self._unit_starts = [0]  # token offset of each unit
        for u in units:
            self._unit_starts.append(self._unit_starts[-1] + u["tokens"])
        self._names = [u["name"] for u in units]
        self._files: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._id_limit: tuple[int, str] | None = None  # (ids must be below, its key): check_vocab
        self.num_documents = len(table)
        self.num_tokens = int(self._starts[-1])
        self.bad_records = BadRecords(dict(self.manifest["bad_records"]))

    def _tokens_path(self, unit: int) -> Path:
        return self.directory / f"{self._names[unit]}.tokens.npy"

    def _unit_file(self, unit: int) -> tuple[int, int]:
        """(file descriptor, offset of the first token) of a unit's tokens, kept open among the
        MAX_OPEN_UNITS last used; reader threads share them (os.pread has no file position)."""
        with self._lock:
            opened = self._files.get(unit)
            if opened is None:
                try:
                    fd = os.open(self._tokens_path(unit), os.O_RDONLY)
                except FileNotFoundError:
                    raise self._damaged(unit, "removed after it was opened") from None
                opened = self._files[unit] = (fd, self._offsets[unit])
                if len(self._files) > MAX_OPEN_UNITS:
                    os.close(self._files.popitem(last=False)[1][0])
            else:
                self._files.move_to_end(unit)
            return opened

    def read(self, document: int, start: int, stop: int) -> np.ndarray:
        """Returns int32 [stop - start]: tokens start:stop of `document` (no specials).

        Read with os.pread into a fresh buffer rather than through a memory map: only these
        tokens are read, and the process's memory does not grow with the pages a map would
        keep resident (the kernel's page cache still serves repeated reads)."""
        if not 0 <= start <= stop <= self.lengths[document]:
            raise IndexError(
                f"tokens {start}:{stop} of document {document} (length "
                f"{self.lengths[document]}) are out of range"
            )
        if start == stop:
            return np.zeros(0, np.int32)
        first = int(self._starts[document])
        unit = bisect_right(self._unit_starts, first) - 1
        fd, offset = self._unit_file(unit)
        size = self._dtype.itemsize
        position = offset + (first - self._unit_starts[unit] + start) * size
        data = os.pread(fd, (stop - start) * size, position)
        if len(data) != (stop - start) * size:
            raise self._damaged(unit, "truncated after it was opened")
        ids = np.frombuffer(data, self._dtype).astype(np.int32)
        if self._id_limit is None:
            return ids
        largest = int((ids & ID_BITS).max())  # chat data: without the marks (data.chat.marks)
        if largest >= self._id_limit[0]:
            limit, key = self._id_limit
            problem = (
                f"token id {largest} in document {document} is not below "
                f"{key}={limit} (the file is damaged)"
            )
            raise self._damaged(unit, problem)
        return ids

    def _damaged(self, unit: int, problem: str) -> DamagedCorpus:
        return DamagedCorpus(self._tokens_path(unit), problem, self.remedy)

    def check_vocab(self, vocab_size: int, *, key: str = "model.vocab_size") -> None:
        """Raises a one-line DataError, naming the unit file, if the manifest records a token
        id >= `vocab_size` (the model's embedding rows); from now on every read checks its ids
        against it too, so damage the open-time checks missed is one line, not a NaN loss."""
        for unit, largest in enumerate(self.max_token_ids):
            if largest is not None and largest >= vocab_size:
                raise DataError(
                    f"{self._tokens_path(unit)}: token ids up to {largest}, not all below "
                    f"{key}={vocab_size}; raise {key} to {largest + 1} or more, or prepare "
                    "the corpus with the tokenizer of the model"
                )
        self._id_limit = (vocab_size, key)

    def __del__(self) -> None:
        for fd, _ in getattr(self, "_files", {}).values():
            os.close(fd)

    def check_tokenizer(self, tokenizer: str, *, key: str = "data.tokenizer") -> None:
        """Raises a one-line DataError if `tokenizer` is not the one the directory was made with."""
        made = self.manifest["tokenizer"]
        if tokenizer_identity(tokenizer) == made:
            return
        name = self.manifest["tokenizer_name"]
        raise DataError(
            f"{key}={tokenizer!r} is not the tokenizer {self.directory} was prepared with "
            f"({made['kind']}, vocab_size {made['vocab_size']}, from {name!r}); set "
            f"{key}={name}, or prepare again with --tokenizer {tokenizer} into another --out"
        )
