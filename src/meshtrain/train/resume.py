"""Whether a checkpoint can be continued by this run: its saved config compared with this one
(meshtrain.config.resume holds which keys are refused, allowed or ignored), with the values the
config alone does not show filled in: the global batch in sequences and the tokenizer's
identity (its files' contents, not its path)."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from meshtrain.config.resume import compare, flatten, refusal
from meshtrain.config.schema import Config
from meshtrain.data.shards import tokenizer_identity
from meshtrain.errors import ConfigError
from meshtrain.inference.lora_base import base_identity, compared_bases, reference_identity

log = logging.getLogger(__name__)


def run_meta(cfg: Config) -> dict[str, Any]:
    """What each checkpoint's meta/ records of the run: its config, its tokenizer's identity
    (None for synthetic data, which has no tokenizer), a LoRA run's base and a preference run's
    reference copy of the starting weights (inference.lora_base)."""
    synthetic = cfg.data.source == "synthetic"
    return {
        "config": asdict(cfg),
        "tokenizer": None if synthetic else tokenizer_identity(cfg.data.tokenizer),
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
