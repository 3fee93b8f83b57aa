"""Text sources tokenised once: a prepared directory (meshtrain.data.shards) per set of files,
cached on disk (data.cache_dir), so that a second launch neither reads nor tokenises them again.

An entry is named by a hash of everything its tokens depend on: each file's absolute path, size
and modification time (in order), the directory the document keys are relative to, the
tokenizer (meshtrain.data.shards.tokenizer_identity: its kind, special ids and its files'
contents), data.text_key, data.on_bad_record, chat data's options (meshtrain.data.chat.records)
and the source of the modules that read and
tokenise. Editing, adding or removing a file therefore makes a new entry; nothing is ever
served stale. A hit is opened as it is: start-up costs a stat per file, and the checks of
meshtrain.data.integrity (data.verify). An entry that fails them is deleted, with a warning,
and tokenised again: the cache can always be rebuilt.

An entry is prepared in a directory of its own and renamed into place, so processes sharing
the cache (several on one host, or a shared home directory) never see half an entry. Past
MAX_CACHE_BYTES the least recently used entries are deleted; the whole directory can be deleted
at any time. With data.cache_dir=null the files are tokenised into a temporary directory that
lives as long as the process.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from meshtrain.data.integrity import DamagedCorpus
from meshtrain.data.prepare import prepare
from meshtrain.data.shards import MANIFEST, PreparedCorpus, tokenizer_identity
from meshtrain.units import GIB, format_bytes

log = logging.getLogger(__name__)

MAX_CACHE_BYTES = 16 * GIB
"""Entries beyond this total are deleted, least recently used first (never the one in use)."""
_FORMAT_VERSION = 2
# The code whose output an entry holds: a change to any of these files makes new entries.
_SOURCES = (
    "sources.py",
    "shards.py",
    "integrity.py",
    "prepare.py",
    "tokenizer.py",
    "corpus_cache.py",
    "parts.py",
    "chat/encoder.py",
    "chat/template.py",
    "chat/records.py",
    "chat/pairs.py",
    "chat/marks.py",
)


def _code_digest() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


def corpus_key(
    files: Sequence[Path],
    root: Path,
    *,
    tokenizer: str,
    text_key: str,
    on_bad_record: str,
    chat: dict[str, Any] | None = None,
) -> str:
    """The cache key of the tokens of `files` (in this order)."""
    digest = hashlib.sha256()
    header = {
        "format": _FORMAT_VERSION,
        "code": _code_digest(),
        "root": os.path.abspath(root),
        "tokenizer": tokenizer_identity(tokenizer),
        "text_key": text_key,
        "on_bad_record": on_bad_record,
        "chat": chat,  # chat data: the record keys, train_on and the template's hash
    }
    digest.update(json.dumps(header, sort_keys=True).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{os.path.abspath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def _entry_bytes(entry: Path) -> int:
    return sum(f.stat().st_size for f in entry.iterdir() if f.is_file())


def _evict(directory: Path, keep: Path, max_bytes: int | None = None) -> None:
    """Deletes the least recently used entries until the rest fit in max_bytes (MAX_CACHE_BYTES)."""
    limit = MAX_CACHE_BYTES if max_bytes is None else max_bytes
    entries = []
    for entry in directory.iterdir():
        with suppress(OSError):
            if (entry / "manifest.json").is_file():
                entries.append((entry.stat().st_mtime, _entry_bytes(entry), entry))
    total = sum(size for _, size, _ in entries)
    for _, size, entry in sorted(entries):
        if total <= limit:
            break
        if entry != keep:
            shutil.rmtree(entry, ignore_errors=True)
            total -= size


def _temporary_directory() -> Path:
    directory = Path(tempfile.mkdtemp(prefix="meshtrain-data-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def cache_remedy(entry: Path) -> str:
    """The fix a damaged cache entry's error ends with, where it is found after opening."""
    return f"delete {entry}: the data cache tokenises its files again at the next launch"


def _cached(entry: Path, verify: str) -> PreparedCorpus | None:
    """The entry, opened and checked (data.verify); None if there is none, or if it was damaged
    (then it is deleted, with a warning, to be tokenised again)."""
    if not (entry / MANIFEST).is_file():
        return None
    try:
        corpus = PreparedCorpus(entry, verify=verify, remedy=cache_remedy(entry))
    except DamagedCorpus as err:
        log.warning(
            "data: %s: %s; deleted this cache entry to tokenise again", err.path, err.problem
        )
        shutil.rmtree(entry, ignore_errors=True)
        return None
    with suppress(OSError):
        os.utime(entry)  # the modification time orders the entries for eviction
    return corpus


def tokenised_corpus(
    files: Sequence[Path],
    root: Path,
    *,
    tokenizer: str,
    text_key: str,
    on_bad_record: str,
    directory: Path | None,
    verify: str = "quick",
    chat: dict[str, Any] | None = None,
) -> PreparedCorpus:
    """The tokens of `files`: the cached entry under `directory` (checked as `verify` says), or
    tokenised now (and cached, unless `directory` is None)."""
    options = {
        "tokenizer": tokenizer,
        "text_key": text_key,
        "on_bad_record": on_bad_record,
        "chat": chat,
    }
    if directory is None:
        return _tokenise(files, root, _temporary_directory() / "corpus", options)
    entry = directory / corpus_key(files, root, **options)
    corpus = _cached(entry, verify)
    if corpus is not None:
        log.debug("data: %d files from the cache %s", len(files), entry)
        return corpus
    try:
        directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=directory))
    except OSError as err:
        log.warning("could not cache the tokenised corpus in %s: %s", directory, err)
        return _tokenise(files, root, _temporary_directory() / "corpus", options)
    _tokenise(files, root, staging / "corpus", options)
    with suppress(OSError):  # another process put the same entry in place first: use that one
        os.rename(staging / "corpus", entry)
    shutil.rmtree(staging, ignore_errors=True)
    log.info("data: cached in %s", entry)
    _evict(directory, keep=entry)
    return PreparedCorpus(entry, remedy=cache_remedy(entry))


def _tokenise(files: Sequence[Path], root: Path, out: Path, options: dict) -> PreparedCorpus:
    start = time.perf_counter()
    corpus = prepare(files, out, root=root, **options)
    log.info(
        "data: tokenised %d documents (%s tokens, %s on disk) from %d files in %.1f s",
        corpus.num_documents,
        f"{corpus.num_tokens:,}",
        format_bytes(_entry_bytes(out)),
        len(files),
        time.perf_counter() - start,
    )
    return corpus
