"""Where meshtrain's caches live: the root directory of them all, and the directory a
cache-directory key names (training.compilation_cache_dir, data.cache_dir). meshtrain.config.schema
re-exports these names."""

from __future__ import annotations

import os
from pathlib import Path

AUTO_CACHE = "auto"
"""The value of a cache-directory key (training.compilation_cache_dir, data.cache_dir) that puts
the cache under cache_root(); null turns that cache off; any other value is its directory."""
CACHE_ROOT_ENV = "MESHTRAIN_CACHE_DIR"


def cache_root() -> Path:
    """Root of meshtrain's caches on this machine (the compilation cache, packed corpora, the
    measured CPU peak): $MESHTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/meshtrain, else
    ~/.cache/meshtrain. Everything in it can be deleted at any time."""
    if os.environ.get(CACHE_ROOT_ENV):
        return Path(os.environ[CACHE_ROOT_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "meshtrain"


def cache_dir(value: str | None, name: str) -> Path | None:
    """The directory a cache-directory key names: "auto" → cache_root()/name, null → None (that
    cache is off), anything else → that path (~ expanded)."""
    if value is None:
        return None
    return cache_root() / name if value == AUTO_CACHE else Path(value).expanduser()
