"""The identity of a run's training data, saved in each checkpoint and compared on resume
(meshtrain.train.resume), so that a data file edited, added or removed in place is refused in
one line instead of being continued silently on other data.

For each config key that names training data (data.paths, data.path with data.glob,
data.mixture[i].paths) it records every file's size and content checksum, keyed by its path
relative to the files' common directory: a directory moved or copied elsewhere keeps its
identity, an appended record does not. The checksum is meshtrain.data.integrity's quick one
(the whole file up to 64 KiB, sixteen evenly spaced 4 KiB blocks beyond), so the default corpus
of 1,740 files costs a fraction of a second; a prepared directory is identified by the sha256 of
its manifest, which holds its units' checksums. Validation data is not recorded (changing it is
allowed on resume).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from meshtrain.config.schema import DataConfig
from meshtrain.data.chat.records import MARKED_SOURCES
from meshtrain.data.integrity import MANIFEST, sample_sha256
from meshtrain.data.sources import list_documents, resolve_paths, resolve_root

FileIdentity = list  # [size in bytes, the checksum's first 16 hex digits]
DataIdentity = dict[str, dict[str, FileIdentity]]  # {config key: {relative path: identity}}

_NAMED = 3  # files a change names before "and N more"


def _file_identity(path: Path) -> FileIdentity:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return [size, sample_sha256(fd, size)[:16]]
    finally:
        os.close(fd)


def _files_identity(files: list[Path], root: Path) -> dict[str, FileIdentity]:
    return {f.relative_to(root).as_posix(): _file_identity(f) for f in files}


def _patterns_identity(patterns: list[str], key: str, records_only: bool):
    """The identity of what `patterns` (data.paths' form) name: prepared directories by their
    manifest, the other files by their contents."""
    identity: dict[str, FileIdentity] = {}
    others = []
    for pattern in patterns:
        manifest = Path(pattern).expanduser() / MANIFEST
        if manifest.is_file():
            digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
            identity[f"{Path(pattern).name}/{MANIFEST}"] = [manifest.stat().st_size, digest]
        else:
            others.append(pattern)
    if others:
        files, root = resolve_paths(others, key=key, records_only=records_only, quiet=True)
        identity.update(_files_identity(files, root))
    return identity


def data_identity(cfg: DataConfig) -> DataIdentity | None:
    """{config key: {file: [size, checksum]}} of the training data `cfg` names (None for
    synthetic data, which reads no file)."""
    if cfg.source == "synthetic":
        return None
    records_only = cfg.source in MARKED_SOURCES
    if cfg.mixture:
        return {
            f"data.mixture[{i}].paths": _patterns_identity(
                list(s.paths), f"data.mixture[{i}].paths", records_only
            )
            for i, s in enumerate(cfg.mixture)
        }
    if cfg.source == "prepared":
        return {"data.path": _patterns_identity([cfg.path], "data.path", records_only)}
    if cfg.paths:
        return {"data.paths": _patterns_identity(list(cfg.paths), "data.paths", records_only)}
    files = list_documents(cfg.path, cfg.glob)
    return {"data.path": _files_identity(files, resolve_root(cfg.path))}


def _sizes(old: FileIdentity, new: FileIdentity) -> str:
    if old[0] == new[0]:
        return f"other contents, same {new[0]:,} bytes"
    return f"{old[0]:,} → {new[0]:,} bytes"


def describe_change(old: Mapping[str, FileIdentity], new: Mapping[str, FileIdentity]) -> str:
    """What changed between two identities of one key's files, in a few words:
    "chats.jsonl: 1,234 → 1,300 bytes; notes.jsonl added" ("" when nothing did)."""
    changed = [
        f"{n}: {_sizes(old[n], new[n])}" for n in sorted(old) if n in new and old[n] != new[n]
    ]
    added = [f"{n} added" for n in sorted(new) if n not in old]
    removed = [f"{n} removed" for n in sorted(old) if n not in new]
    parts = changed + added + removed
    more = f" and {len(parts) - _NAMED} more" if len(parts) > _NAMED else ""
    return "; ".join(parts[:_NAMED]) + more
