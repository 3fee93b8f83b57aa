"""A model's parameters copied onto a mesh, as `meshtrain.load_hf(path, mesh)` would place them."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from meshtrain.config import ModelConfig
from meshtrain.models.abstract import abstract_model, merge_model
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.mesh import resolve_mesh


def on_mesh(model: Transformer, cfg: ModelConfig, mesh_shape: list[Any]) -> Transformer:
    """`model` (built from `cfg` on one device) with each parameter sharded over mesh_shape
    (key/value heads replicated where tp does not divide them, models.abstract.fit_kv_heads)."""
    mesh, spec = resolve_mesh(mesh_shape)
    abstract = abstract_model(cfg, mesh, spec)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return merge_model(abstract, jax.device_put(params, abstract.param_shardings))
