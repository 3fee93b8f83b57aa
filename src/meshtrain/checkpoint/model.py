"""`load_checkpoint`: a ready-to-call model from a meshtrain checkpoint, for generation and
notebooks; the counterpart of `meshtrain.load_hf` for meshtrain's own checkpoints."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from meshtrain.checkpoint.layout import (
    CorruptCheckpoint,
    find_checkpoints,
    read_meta,
    read_params,
)
from meshtrain.config import ModelConfig
from meshtrain.errors import ConfigError
from meshtrain.mesh import resolve_mesh
from meshtrain.models.transformer import Transformer
from meshtrain.train.state import merge_model, plan_model

log = logging.getLogger(__name__)


def _candidates(path: Path) -> list[Path]:
    found = find_checkpoints(Path(path).expanduser())
    if not found:
        raise ConfigError(
            f"{path} holds no complete meshtrain checkpoint (a directory with params/ and "
            "meta/, a directory of step directories, or a run directory with checkpoints/)"
        )
    return found


def checkpoint_config(path: str | Path) -> dict[str, Any]:
    """The resolved run config saved with the newest checkpoint at `path` whose description
    reads back, as a dict ({"model": {...}, "data": {...}, ...})."""
    for candidate in _candidates(Path(path)):
        try:
            return read_meta(candidate)["config"]
        except CorruptCheckpoint as err:
            log.warning("%s; trying the previous checkpoint", err)
    raise ConfigError(f"no readable checkpoint at {path}")


def load_checkpoint(
    path: str | Path,
    mesh: Mesh | list[Any] | None = None,
    *,
    dtype: jnp.dtype = jnp.float32,
) -> Transformer:
    """The model of the newest readable checkpoint at `path` (a step directory such as
    .../checkpoints/200, its checkpoints/ directory, a run directory or an orbax export), built
    from the model config saved with it. `mesh` as in `load_hf`: None (one device), a
    mesh_shape over all visible devices, or a Mesh; each array is read straight into its
    shards. Call it as `model(tokens)`: int32 [B, T] → logits [B, T, vocab_size]."""
    mesh, spec = resolve_mesh(mesh)
    for candidate in _candidates(Path(path)):
        try:
            cfg = ModelConfig(**read_meta(candidate)["config"]["model"])
            plan = plan_model(cfg, mesh, spec)
            target = jax.tree.map(
                lambda leaf, sharding: jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=sharding
                ),
                plan.abstract_params,
                plan.param_shardings,
            )
            params, _ = read_params(candidate, target)
        except CorruptCheckpoint as err:
            log.warning("%s; trying the previous checkpoint", err)
            continue
        return merge_model(plan, jax.tree.map(lambda p: p.astype(dtype), params))
    raise ConfigError(f"no readable checkpoint at {path}")
