"""Whether a checkpoint can be continued by this run: its saved config compared with this one
(meshtrain.config.resume holds which keys are refused, allowed or ignored), with the values the
config alone does not show filled in: the global batch in sequences, the tokenizer's identity
(its files' contents, not its path) and the training data's (meshtrain.data.identity: each
file's size and checksum, so that a file edited in place is a change of its config key)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from meshtrain.config.resume import compare, flatten, refusal
from meshtrain.config.schema import Config
from meshtrain.data.identity import data_identity, describe_change
from meshtrain.data.shards import tokenizer_identity
from meshtrain.errors import ConfigError
from meshtrain.weights.lora_base import base_identity, compared_bases, reference_identity

log = logging.getLogger(__name__)


def run_meta(cfg: Config) -> dict[str, Any]:
    """What each checkpoint's meta/ records of the run: its config, its tokenizer's identity
    (None for synthetic data, which has no tokenizer), its training data's identity, a LoRA
    run's base and a preference run's reference copy of the starting weights
    (weights.lora_base)."""
    synthetic = cfg.data.source == "synthetic"
    return {
        "config": asdict(cfg),
        "tokenizer": None if synthetic else tokenizer_identity(cfg.data.tokenizer),
        "data_files": data_identity(cfg.data),
        "lora_base": base_identity(cfg),
        "reference": reference_identity(cfg),
    }


def _compared(config: dict[str, Any], global_batch: int | None) -> dict[str, Any]:
    """The flattened config as resume compares it: the global batch in sequences, and the
    training data's validation fraction as it applies (none is held out of the training data
    where data.validation_paths is set)."""
    flat = flatten(config)
    if global_batch is None:  # a checkpoint that lacks it: not compared
        del flat["training.global_batch_size"]
    else:
        flat["training.global_batch_size"] = global_batch
    if flat.get("data.validation_paths"):
        flat["data.validation_fraction"] = 0.0
    return flat


def _tokenizers(saved_meta: dict[str, Any], current: dict[str, Any]) -> tuple[str, str]:
    """(saved, current) data.tokenizer as compared: the names, equal where the identities are
    (a tokenizer file that moved), and told apart where the same name has other contents."""
    old, new = saved_meta["config"]["data"]["tokenizer"], current["config"]["data"]["tokenizer"]
    old_id, new_id = saved_meta.get("tokenizer"), current["tokenizer"]
    if old_id is None or new_id is None:  # older checkpoints, or synthetic data
        return old, new
    if old_id == new_id:
        return new, new
    if old == new:
        return f"{old} (vocab_size {old_id['vocab_size']})", f"{new} (other contents)"
    return old, new


def _data_files(saved: dict, now: dict, saved_meta: dict, current: dict) -> None:
    """Marks, in the flattened configs, a data key whose value is unchanged but whose files
    are not: "["chats.jsonl"] → ["chats.jsonl"] with other files (chats.jsonl: 1,234 → 1,300
    bytes)". Checkpoints saved before the data's identity was recorded are not compared."""
    old_ids, new_ids = saved_meta.get("data_files"), current.get("data_files")
    if not old_ids or not new_ids:
        return
    for key in old_ids.keys() & new_ids.keys():
        change = describe_change(old_ids[key], new_ids[key])
        if change and key in saved and saved[key] == now.get(key):
            shown = json.dumps(saved[key]) if saved[key] is not None else "(the default corpus)"
            saved[key], now[key] = shown, f"{shown} with other files ({change})"


def check_resume(
    meta: dict[str, Any], path: Path, current: dict[str, Any], global_batch: int
) -> None:
    """Raises ConfigError (one line) if the checkpoint at `path`, described by `meta`, was
    trained on what this run (`current`: run_meta(cfg)) would compute or read differently, and
    logs the changes that are allowed. A checkpoint without a saved config is not compared."""
    if "config" not in meta:
        return
    cfg = current["config"]
    saved = _compared(meta["config"], meta.get("global_batch"))
    now = _compared(cfg, global_batch)
    saved["data.tokenizer"], now["data.tokenizer"] = _tokenizers(meta, current)
    _data_files(saved, now, meta, current)
    if meta.get("lora_base") or current.get("lora_base"):
        bases = compared_bases(meta.get("lora_base"), current.get("lora_base"))
        saved["model.lora.base"], now["model.lora.base"] = bases
    if meta.get("reference") or current.get("reference"):
        references = compared_bases(meta.get("reference"), current.get("reference"))
        saved["objective.reference_weights"], now["objective.reference_weights"] = references
    changes = compare(saved, now, cfg["checkpoint"]["allow_changes"])
    if any(change.refused for change in changes):
        adapters = bool(meta["config"]["model"].get("lora", {}).get("rank"))
        raise ConfigError(refusal(changes, str(path), adapters=adapters))
    if changes:
        log.info("resuming with changed settings: %s", ", ".join(map(str, changes)))
