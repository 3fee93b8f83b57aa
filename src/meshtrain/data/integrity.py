"""Checks that a prepared directory's unit files are the files its manifest describes, when the
directory is opened (meshtrain.data.shards.PreparedCorpus), so that a damaged corpus stops the
run in one line before anything compiles instead of hours into training.

Every open checks each unit's two files: present, a readable .npy header holding the dtype and
shape the manifest's counts give, the exact byte size that follows from them, the full sha256
of the small document table, and a sampled sha256 of the token file: its size and
SAMPLE_BLOCKS evenly spaced blocks of SAMPLE_BYTES (a whole file up to their total), a few
milliseconds per gigabyte. data.verify=full hashes every byte of the token files instead and
checks every token id. Manifests written before these checksums existed get every check but
the checksums.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from meshtrain.data.chat.marks import ID_BITS
from meshtrain.errors import DataError

MANIFEST = "manifest.json"
VERIFY_MODES = ("quick", "full")  # data.verify (meshtrain.config.schema.DataVerify)
SAMPLE_BLOCKS = 16  # blocks of a token file the quick checksum reads
SAMPLE_BYTES = 4096  # bytes per block
CHUNK_BYTES = 16 << 20  # full verification reads the token files in chunks of this size
REPREPARE = "prepare the corpus again into an empty directory"
DOCS_DTYPE = np.dtype("<u8")  # the document table: (token count, key hash) per document


class DamagedCorpus(DataError):
    """A file of a prepared directory that is not what its manifest describes; one line that
    names the file, what is wrong and the remedy."""

    def __init__(self, path: Path, problem: str, remedy: str):
        super().__init__(f"{path}: {problem}; {remedy}")
        self.path, self.problem = path, problem


def sample_offsets(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the blocks the quick checksum reads from a file of `size` bytes: the
    whole file if it is at most SAMPLE_BLOCKS × SAMPLE_BYTES, else evenly spaced blocks from
    its first byte to its last."""
    if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        return [(0, size)]
    last = size - SAMPLE_BYTES
    return [(last * i // (SAMPLE_BLOCKS - 1), SAMPLE_BYTES) for i in range(SAMPLE_BLOCKS)]


def sample_sha256(fd: int, size: int) -> str:
    """The quick checksum of an open file of `size` bytes: sha256 of the size (8 bytes,
    little-endian) and the blocks of sample_offsets."""
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    for offset, length in sample_offsets(size):
        digest.update(os.pread(fd, length, offset))
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of every byte of `path`."""
    digest = hashlib.sha256()
    hash_file_into(digest, path)
    return digest.hexdigest()


def hash_file_into(digest: Any, path: Path) -> None:
    """Feed every byte of `path` to `digest` (a hashlib object), CHUNK_BYTES at a time."""
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)


def unit_checks(tokens_path: Path, docs_path: Path, flat: np.ndarray) -> dict[str, Any]:
    """What the manifest records of a unit just written, to check it when it is opened: the
    checksums of its files and its largest token id (None: no tokens). `flat` holds its ids."""
    size = tokens_path.stat().st_size
    fd = os.open(tokens_path, os.O_RDONLY)
    try:
        sampled = sample_sha256(fd, size)
    finally:
        os.close(fd)
    return {
        "tokens_sha256": file_sha256(tokens_path),
        "tokens_sample_sha256": sampled,
        "docs_sha256": file_sha256(docs_path),
        "max_token_id": _largest_id(flat),
    }


def _header(f: Any, path: Path, remedy: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, offset of the data) of the .npy file open as `f`."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    except Exception:  # numpy raises ValueError, SyntaxError or tokenize.TokenError
        raise DamagedCorpus(path, "its .npy header is unreadable", remedy) from None
    if fortran:
        raise DamagedCorpus(path, "its .npy header says Fortran order", remedy)
    return shape, dtype, f.tell()


def _open_npy(path: Path, dtype: np.dtype, shape: tuple[int, ...], remedy: str) -> tuple[Any, int]:
    """Opens a unit file and checks it against the manifest: present, its header holding
    `dtype` and `shape`, and exactly as long as they make it. Returns (open file, data offset)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (the caller closes it)
    except FileNotFoundError:
        raise DamagedCorpus(path, f"missing, though {MANIFEST} lists it", remedy) from None
    try:
        found_shape, found_dtype, offset = _header(f, path, remedy)
        if (found_dtype, tuple(found_shape)) != (dtype, shape):
            raise DamagedCorpus(
                path,
                f"holds {found_dtype.name} {list(found_shape)}, not the {dtype.name} "
                f"{list(shape)} that {MANIFEST} lists",
                remedy,
            )
        size, expected = os.fstat(f.fileno()).st_size, offset + int(np.prod(shape)) * dtype.itemsize
        if size != expected:
            raise DamagedCorpus(
                path,
                f"{size} bytes, not the {expected} that {MANIFEST} gives (truncated or overwritten)",
                remedy,
            )
    except BaseException:
        f.close()
        raise
    return f, offset


def _mismatch(path: Path, remedy: str) -> DamagedCorpus:
    problem = f"its content does not match its checksum in {MANIFEST} (damaged since prepared)"
    return DamagedCorpus(path, problem, remedy)


def _full_pass(f: Any, offset: int, dtype: np.dtype) -> tuple[str, int | None]:
    """(sha256 of every byte, largest token id or None) of a token file open as `f`."""
    f.seek(0)
    digest, largest = hashlib.sha256(f.read(offset)), None
    while chunk := f.read(CHUNK_BYTES - CHUNK_BYTES % dtype.itemsize):
        digest.update(chunk)
        ids = np.frombuffer(chunk, dtype)
        if ids.size:
            peak = int(ids.max())
            largest = peak if largest is None else max(largest, peak)
    return digest.hexdigest(), largest


def check_tokens(
    path: Path, unit: dict[str, Any], dtype: np.dtype, *, full: bool, remedy: str
) -> tuple[int, int | None]:
    """Checks a unit's token file against its manifest `unit` entry (full: every byte, else the
    sampled checksum). Returns (offset of its first token, its largest token id: recorded in the
    manifest, found by the full pass, or None if unknown)."""
    f, offset = _open_npy(path, dtype, (unit["tokens"],), remedy)
    with f:
        largest = unit.get("max_token_id")
        if full:
            sha256, largest = _full_pass(f, offset, dtype)
            recorded = unit.get("tokens_sha256")
            if recorded is not None and sha256 != recorded:
                raise _mismatch(path, remedy)
        elif unit.get("tokens_sample_sha256") is not None:
            size = os.fstat(f.fileno()).st_size
            if sample_sha256(f.fileno(), size) != unit["tokens_sample_sha256"]:
                raise _mismatch(path, remedy)
    return offset, largest


def read_docs(path: Path, unit: dict[str, Any], remedy: str) -> np.ndarray:
    """A unit's document table, uint64 [documents, 2], checked against its manifest entry: the
    header, the size, the sha256 of the whole file, and its lengths summing to the unit's
    tokens."""
    f, offset = _open_npy(path, DOCS_DTYPE, (unit["documents"], 2), remedy)
    with f:
        f.seek(0)
        data = f.read()
    recorded = unit.get("docs_sha256")
    if recorded is not None and hashlib.sha256(data).hexdigest() != recorded:
        raise _mismatch(path, remedy)
    table = np.frombuffer(data, DOCS_DTYPE, offset=offset).reshape(-1, 2)
    total = int(table[:, 0].sum())
    if total != unit["tokens"]:
        raise DamagedCorpus(
            path,
            f"its documents hold {total} tokens, not the {unit['tokens']} that {MANIFEST} lists",
            remedy,
        )
    return table


def _largest_id(flat: np.ndarray) -> int | None:
    """The largest token id of a unit's tokens, without chat data's marks (data.chat.marks: uint32
    ids only); None for no tokens."""
    if not flat.size:
        return None
    return int((flat & np.uint32(ID_BITS)).max() if flat.dtype == np.uint32 else flat.max())
