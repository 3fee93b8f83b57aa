"""A Hugging Face model id (`Qwen/Qwen3-0.6B`) where a config names a local directory
(model.init_from=hf:ID, data.tokenizer=ID): resolved to its snapshot in the local Hugging Face
cache, offline first, as huggingface_hub does with local_files_only, and downloaded into that
cache only where it is missing, huggingface_hub is installed and HF_HUB_OFFLINE is not set.

The cache is huggingface_hub's: $HF_HUB_CACHE, else $HF_HOME/hub, else
$XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub. A model's snapshot is
models--<org>--<name>/snapshots/<commit>/, the commit read from refs/main (or the only
snapshot there). The resolved directory is what the run records, so a resume or an export
reads the same files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from meshtrain.errors import ConfigError, first_line

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the Hub spells ids
DOWNLOADED = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def hub_cache() -> Path:
    """The directory huggingface_hub keeps its snapshots in."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a Hub id rather than a local path (which would exist)."""
    return bool(HUB_ID.match(name)) and not Path(name).expanduser().exists()


def cached_snapshot(repo_id: str, cache: Path | None = None) -> Path | None:
    """The cached snapshot of `repo_id` (its refs/main commit, else its only snapshot)."""
    model = (cache or hub_cache()) / f"models--{repo_id.replace('/', '--')}"
    ref = model / "refs" / "main"
    if ref.is_file():
        snapshot = model / "snapshots" / ref.read_text().strip()
        return snapshot if snapshot.is_dir() else None
    snapshots = [p for p in (model / "snapshots").glob("*") if p.is_dir()]
    return snapshots[0] if len(snapshots) == 1 else None


def resolve_hub_id(key: str, repo_id: str) -> Path:
    """The local directory of `repo_id`, named by config key `key`: from the cache, else
    downloaded into it; a one-line ConfigError where neither can be."""
    if (found := cached_snapshot(repo_id)) is not None:
        return found
    cache = hub_cache()
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    where = f"{key}={repo_id!r} is neither a local path nor in the Hugging Face cache ({cache})"
    if offline:
        raise ConfigError(
            f"{where}, and HF_HUB_OFFLINE is set; download it where the network reaches the "
            f"Hub (huggingface-cli download {repo_id}) or give its local directory"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(
            f"{where}; pip install huggingface_hub to download it, or download it elsewhere "
            f"(huggingface-cli download {repo_id}) and give its local directory"
        ) from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=DOWNLOADED, cache_dir=cache))
    except Exception as err:  # no network, an unknown or gated model
        reason = first_line(err) or type(err).__name__
        raise ConfigError(
            f"{where}, and downloading it failed ({reason}); give its local directory"
        ) from None
