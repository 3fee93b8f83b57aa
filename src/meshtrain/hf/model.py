"""`load_hf`: a ready-to-call meshtrain model from a local Hugging Face checkpoint directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from meshtrain.config import ModelConfig
from meshtrain.hf.checkpoint import check_init_from, load_params
from meshtrain.hf.config import model_config_from_hf, read_config_json
from meshtrain.mesh import resolve_mesh
from meshtrain.models.transformer import Transformer
from meshtrain.train.state import merge_model, plan_model


def hf_model_config(path: str | Path, **fields: Any) -> ModelConfig:
    """The ModelConfig of the checkpoint in `path` (from its config.json), plus `fields`."""
    directory = Path(path).expanduser()
    return model_config_from_hf(
        read_config_json(directory),
        name=directory.name,
        source=str(directory / "config.json"),
        **fields,
    )


def load_hf(
    path: str | Path,
    mesh: Mesh | list[Any] | None = None,
    *,
    dtype: jnp.dtype = jnp.float32,
    scan_layers: bool = False,
) -> Transformer:
    """The model of the checkpoint in `path` (config.json and *.safetensors), parameters in
    `dtype`. `mesh`: None (one device), a mesh_shape such as [[4,2],["fsdp","tp"]] over all
    visible devices, or a Mesh from `meshtrain.mesh.build_mesh`; each device then holds only its
    shards. Call it as `model(tokens)`: int32 [B, T] → logits [B, T, vocab_size]."""
    directory = Path(path).expanduser()
    cfg = hf_model_config(directory, scan_layers=scan_layers, init_from=f"hf:{directory}")
    check_init_from(cfg)  # every tensor present with its shape, before anything is allocated
    mesh, spec = resolve_mesh(mesh)
    plan = plan_model(cfg, mesh, spec)
    params = load_params(directory, cfg, plan.abstract_params, plan.param_shardings, dtype=dtype)
    return merge_model(plan, params)
