"""A LoRA run's frozen base (model.lora): where it comes from, its identity, and the line that
says what trains.

The base is read at every start, fresh or resumed, from the same place as a full fine-tune's
initial weights (model.init_from=hf:DIR, checkpoint.load_params, else the seed's random init),
then stored as model.lora.base_dtype says (models.frozen). Checkpoints hold the adapters and
their optimizer state only; their meta/ records the base's identity (`base_identity`: where it
came from and the sha256 of its files), which a resume compares by content as
`model.lora.base`.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Any

import jax

from meshtrain.config.lora import target_projections
from meshtrain.config.objective import reads_reference
from meshtrain.config.schema import Config, ModelConfig
from meshtrain.data.integrity import hash_file_into
from meshtrain.errors import ConfigError
from meshtrain.hf.load import checkpoint_dir
from meshtrain.hf.peft import load_peft
from meshtrain.models.abstract import AbstractModel
from meshtrain.models.frozen import is_quantized, store_base
from meshtrain.models.initialization import initial_params
from meshtrain.models.lora import split_adapters
from meshtrain.models.quantize import storage_bytes
from meshtrain.units import format_bytes
from meshtrain.weights.initial_weights import load_initial_params

log = logging.getLogger(__name__)


def load_frozen_base(
    cfg: Config, model: AbstractModel, *, checkpoint_dir_of_run: Path | None = None
) -> Any:
    """The frozen base in its stored form and shardings (model.frozen_params).
    checkpoint_dir_of_run: as in load_initial_params (None outside a run)."""
    dtype = jax.tree.leaves(model.frozen_params, is_leaf=is_quantized)[0].dtype
    base = load_initial_params(
        cfg, model, checkpoint_dir_of_run=checkpoint_dir_of_run, hf_dtype=dtype
    )
    if base is None:
        full = initial_params(cfg.model, cfg.training.seed, model.param_shardings)
        base = split_adapters(full)[1]
        log.info("LoRA base: the random init of training.seed=%d", cfg.training.seed)
    return store_base(base, model.frozen_params, model.frozen_shardings)


def initial_adapters(cfg: Config, model: AbstractModel) -> Any:
    """A fresh LoRA run's adapters: read from model.lora.init_from (a PEFT adapter), else None
    (drawn: A random, B zero, by train.state.create_train_state)."""
    if cfg.model.lora.init_from is None:
        return None
    adapters = load_peft(cfg.model, model.trainable_params, model.trainable_shardings)
    log.info("LoRA adapters from %s", cfg.model.lora.init_from)
    return adapters


def _files_sha256(root: Path) -> str:
    """sha256 over the relative names and contents of every file under `root`, in order."""
    digest = hashlib.sha256()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        digest.update(str(path.relative_to(root) if path != root else path.name).encode())
        hash_file_into(digest, path)
    return digest.hexdigest()


def check_base_unchanged(cfg: Config, saved: dict[str, Any] | None, where: Path) -> None:
    """ConfigError unless the base `cfg` names is the one the adapters at `where` were trained
    on (`saved`: the identity their checkpoint recorded)."""
    current = base_identity(cfg)
    if saved is None or current is None or saved["sha256"] == current["sha256"]:
        return
    raise ConfigError(
        f"{where} holds LoRA adapters trained on {saved['source']} (sha256 "
        f"{saved['sha256'][:12]}), but its files now hash to {current['sha256'][:12]}: the "
        "base has changed; put the original base back at that path"
    )


def base_identity(cfg: Config) -> dict[str, Any] | None:
    """Where a LoRA run's base comes from and the sha256 of its files; None without LoRA."""
    return starting_weights_identity(cfg) if cfg.model.lora.rank else None


def reference_identity(cfg: Config) -> dict[str, Any] | None:
    """The identity of a preference run's reference where it is a copy of the starting weights
    (objective.reference=initial without LoRA, whose reference is its base); else None."""
    copy = reads_reference(cfg.objective) and not cfg.model.lora.rank
    return starting_weights_identity(cfg) if copy else None


def starting_weights_identity(cfg: Config) -> dict[str, Any]:
    """Where the weights a fresh run starts from come from and the sha256 of their files; random
    weights are named by their seed (training.seed, which a resume compares anyway)."""
    if cfg.checkpoint.load_params:
        source = f"checkpoint.load_params={cfg.checkpoint.load_params}"
        return {"source": source, "sha256": _files_sha256(Path(cfg.checkpoint.load_params))}
    if cfg.model.init_from is not None:
        directory = checkpoint_dir(cfg.model.init_from)
        return {"source": cfg.model.init_from, "sha256": _files_sha256(directory)}
    return {"source": f"random init, training.seed={cfg.training.seed}", "sha256": None}


def compared_bases(saved: dict | None, current: dict | None) -> tuple[str, str]:
    """(saved, current) model.lora.base as a resume compares them: equal where the contents
    are (a base that moved), told apart by their sources, or by their contents."""
    if saved is None or current is None:
        return str(saved and saved["source"]), str(current and current["source"])
    if saved["sha256"] == current["sha256"] and saved["source"].startswith("random") == (
        current["source"].startswith("random")
    ):
        return current["source"], current["source"]
    if saved["source"] == current["source"]:
        return f"{saved['source']} (sha256 {saved['sha256'][:12]})", (
            f"{current['source']} (other contents, sha256 {current['sha256'][:12]})"
        )
    return saved["source"], current["source"]


def _count(tree: Any) -> int:
    """The number of values in the arrays (or shapes) of `tree`."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def lora_summary(cfg: ModelConfig, model: AbstractModel) -> str:
    """The start-up line: the adapters, how many parameters train, how the base is stored."""
    lora = cfg.lora
    trainable, total = _count(model.trainable_params), _count(model.abstract_params)
    frozen = jax.tree.leaves(model.frozen_params, is_leaf=is_quantized)
    stored = sum(map(_stored_bytes, frozen))
    return (
        f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(target_projections(cfg))}: "
        f"{trainable:,} trainable parameters ({100 * trainable / total:.2f}% of {total:,}); "
        f"the base is frozen, stored as {lora.base_dtype}"
        + (f" (blocks of {lora.quant_block})" if lora.base_dtype in ("int8", "nf4") else "")
        + f": {format_bytes(stored)}"
    )


# Adapters with more parameters than this share of the base get a warning at start-up.
LARGE_ADAPTERS = 0.5


def large_adapters_warning(model: AbstractModel) -> str | None:
    """The start-up warning for adapters larger than LARGE_ADAPTERS of the base, else None."""
    adapters = _count(model.trainable_params)
    base = _count(model.abstract_params) - adapters
    if adapters <= LARGE_ADAPTERS * base:
        return None
    return (
        f"the adapters hold {adapters / base:.0%} as many parameters as the base: LoRA saves "
        "little over full fine-tuning here; a smaller model.lora.rank (e.g. 16) is what it is for"
    )


def _stored_bytes(leaf: Any) -> int:
    if is_quantized(leaf):
        return storage_bytes(leaf.shape, leaf.format, leaf.block, leaf.axis)
    return math.prod(leaf.shape) * leaf.dtype.itemsize
