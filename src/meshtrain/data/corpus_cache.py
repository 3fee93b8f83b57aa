"""The packed sequences of a text_files corpus, cached on disk (data.cache_dir) so that a second
launch neither reads nor tokenises the documents again.

An entry is one split's int32 [num_sequences, seq_len + 1] array in a .npy file named by a hash
of everything the array depends on: each document's absolute path, size and modification time
(in the split's order), the tokenizer (its kind, special ids, and its files' paths, sizes and
modification times), seq_len, the versions of the tokenizer libraries and the source of the
modules that read, tokenise and pack. Editing, adding or removing a document therefore makes a
new entry; nothing is ever served stale. A hit is memory-mapped read-only: start-up costs a
directory walk and a stat per document, and the pages are read as batches need them.

Entries are written to a temporary file and renamed, so concurrent processes (several on one
host, or on a shared home directory) never see half a file. Past MAX_CACHE_BYTES the least
recently used entries are deleted; the whole directory can be deleted at any time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path

import numpy as np
import sentencepiece
import tokenizers

from meshtrain.data.tokenizer import Tokenizer
from meshtrain.units import GIB, format_bytes

log = logging.getLogger(__name__)

MAX_CACHE_BYTES = 4 * GIB
"""Entries beyond this total are deleted, least recently used first (never the newest)."""
_FORMAT_VERSION = 1
# The code whose output an entry holds: a change to any of these files makes new entries.
_SOURCES = ("corpus.py", "packing.py", "tokenizer.py", "corpus_cache.py")


def _file_stamp(path: Path) -> str:
    stat = path.stat()
    return f"{os.path.abspath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}"


def _tokenizer_identity(tokenizer: Tokenizer) -> dict:
    libraries = {
        "tokenizers": getattr(tokenizers, "__version__", "?"),
        "sentencepiece": getattr(sentencepiece, "__version__", "?"),
    }
    return {
        "kind": type(tokenizer).__name__,
        "vocab_size": tokenizer.vocab_size,
        "special_ids": [tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id],
        "files": [_file_stamp(Path(f)) for f in tokenizer.source_files],
        "libraries": libraries,
    }


def _code_digest() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


def corpus_key(documents: Sequence[Path], tokenizer: Tokenizer, seq_len: int) -> str:
    """The cache key of the packed sequences of `documents` (in this order)."""
    digest = hashlib.sha256()
    header = {
        "format": _FORMAT_VERSION,
        "code": _code_digest(),
        "seq_len": seq_len,
        "tokenizer": _tokenizer_identity(tokenizer),
    }
    digest.update(json.dumps(header, sort_keys=True).encode())
    for path in documents:
        digest.update(_file_stamp(path).encode() + b"\n")
    return digest.hexdigest()[:32]


def _load(file: Path, seq_len: int) -> np.ndarray | None:
    try:
        sequences = np.load(file, mmap_mode="r")
    except (OSError, ValueError):  # missing, or unreadable: rebuilt
        return None
    if sequences.dtype != np.int32 or sequences.ndim != 2 or sequences.shape[1] != seq_len + 1:
        return None
    with suppress(OSError):
        os.utime(file)  # the modification time orders the entries for eviction
    return sequences


def _store(directory: Path, file: Path, sequences: np.ndarray) -> None:
    tmp = directory / f".{file.stem}.{os.getpid()}.tmp.npy"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        np.save(tmp, sequences)
        os.replace(tmp, file)
    except OSError as err:
        log.warning("could not cache the packed corpus in %s: %s", directory, err)
        tmp.unlink(missing_ok=True)
        return
    _evict(directory, keep=file)


def _evict(directory: Path, keep: Path, max_bytes: int | None = None) -> None:
    """Deletes the least recently used entries until the rest fit in max_bytes (MAX_CACHE_BYTES)."""
    limit = MAX_CACHE_BYTES if max_bytes is None else max_bytes
    entries = []
    for file in directory.glob("*.npy"):
        try:
            stat = file.stat()
        except OSError:
            continue
        entries.append((stat.st_mtime, stat.st_size, file))
    total = sum(size for _, size, _ in entries)
    for _, size, file in sorted(entries):
        if total <= limit:
            break
        if file != keep:
            file.unlink(missing_ok=True)
            total -= size


def cached_sequences(
    directory: Path,
    documents: Sequence[Path],
    tokenizer: Tokenizer,
    seq_len: int,
    pack: Callable[[], np.ndarray],
    *,
    split: str,
) -> np.ndarray:
    """The packed sequences of `documents`: the cached entry (read-only, memory-mapped), or
    `pack()` run now and stored for the next launch. Both are the same int32 values."""
    if not documents:
        return pack()
    file = directory / f"{corpus_key(documents, tokenizer, seq_len)}.npy"
    sequences = _load(file, seq_len)
    if sequences is not None:
        log.debug("data: the %s split from the cache %s", split, file)
        return sequences
    start = time.perf_counter()
    sequences = pack()
    _store(directory, file, sequences)
    log.info(
        "data: packed the %s split (%d documents, %s) in %.1f s; cached in %s",
        split,
        len(documents),
        format_bytes(sequences.nbytes),
        time.perf_counter() - start,
        file,
    )
    return sequences
