"""Where a fresh run's parameters come from, in one place: `checkpoint.load_params` (a meshtrain
checkpoint or export), else `model.init_from=hf:/dir` (a local Hugging Face checkpoint), else a
random init (None here; meshtrain.train.state creates it).

`check_initial_weights` runs at start-up, before anything compiles; `load_initial_params` reads
the chosen weights shard by shard into the run's shardings. A resumed run reads neither: its
own checkpoint holds the parameters.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from meshtrain.checkpoint.layout import CorruptCheckpoint, read_meta, read_params
from meshtrain.checkpoint.manager import read_newest
from meshtrain.checkpoint.sources import check_params, checkpoints_at
from meshtrain.config.schema import Config
from meshtrain.hf.load import check_init_from, checkpoint_dir, checkpoint_summary, load_params
from meshtrain.hf.peft import check_peft
from meshtrain.models.abstract import AbstractModel

log = logging.getLogger(__name__)

LOAD_PARAMS = "checkpoint.load_params"


def check_initial_weights(cfg: Config, model: AbstractModel, *, resuming: bool) -> None:
    """ConfigError, naming the key, for weights that cannot start this model. The Hugging Face
    checkpoint is always checked; checkpoint.load_params only when the run does not resume."""
    if cfg.model.init_from is not None:
        check_init_from(cfg.model)
    if cfg.model.lora.init_from is not None and not resuming:
        check_peft(cfg.model)
    if resuming or not cfg.checkpoint.load_params:
        return
    # The newest candidate with a readable description; damaged ones are reported and
    # skipped by load_initial_params.
    for path in checkpoints_at(LOAD_PARAMS, cfg.checkpoint.load_params):
        try:
            read_meta(path)
            check_params(LOAD_PARAMS, path, model.base_params)
        except CorruptCheckpoint:
            continue
        return


def load_initial_params(
    cfg: Config, model: AbstractModel, *, checkpoint_dir_of_run: Path | None, hf_dtype: Any = None
) -> Any:
    """The parameters a fresh run starts from, already sharded; None for a random init. With
    LoRA, those of the base (every parameter but the adapters).

    `checkpoint_dir_of_run`: damaged checkpoints found there are moved aside (as on resume);
    None outside a run.
    hf_dtype: the dtype a Hugging Face checkpoint is read in (default fp32).
    """
    if cfg.checkpoint.load_params:
        target = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            model.base_params,
            model.base_shardings,
        )
        (params, meta), path = read_newest(
            checkpoints_at(LOAD_PARAMS, cfg.checkpoint.load_params),
            lambda p: read_params(p, target),
            key=LOAD_PARAMS,
            own_directory=checkpoint_dir_of_run,
        )
        log.info(
            "parameters from %s (step %s); the optimizer, step and data position start fresh",
            path,
            meta.get("step"),
        )
        return params
    if cfg.model.init_from is not None:
        directory = checkpoint_dir(cfg.model.init_from)
        params = load_params(
            directory,
            cfg.model,
            model.base_params,
            model.base_shardings,
            dtype=hf_dtype or jnp.float32,
        )
        log.info(
            "parameters from %s (%s); the optimizer, step and data position start fresh",
            cfg.model.init_from,
            checkpoint_summary(directory, cfg.model),
        )
        return params
    return None
