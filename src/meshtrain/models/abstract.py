"""The model before it exists: its structure, shapes and shardings, from an abstract init.

`abstract_model` runs the model's constructor under `nnx.eval_shape` (nothing is allocated) and
maps each parameter's logical axes through the rule table to a NamedSharding, checking that every
sharded dimension divides. Training creates its state from it, loaders read weights into its
shardings, and `merge_model` turns a tree of arrays back into a callable module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from meshtrain.config.schema import ModelConfig
from meshtrain.models.attention import check_attention
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.mesh import MeshSpec
from meshtrain.parallel.rules import check_divisible, named_shardings, param_specs


@dataclass(frozen=True)
class AbstractModel:
    """The model's structure and where each array lives, known before anything is allocated."""

    graphdef: nnx.GraphDef
    abstract_state: nnx.State  # nnx.Param variables holding ShapeDtypeStructs
    abstract_params: Any  # the same as a nested dict of ShapeDtypeStruct
    param_shardings: Any  # nested dict of NamedSharding
    config: ModelConfig | None = None  # what it was built from


def abstract_model(cfg: ModelConfig, mesh: Mesh, mesh_spec: MeshSpec) -> AbstractModel:
    """Abstract init (shapes only) plus the logical rules → shardings; checks even division
    and that model.attention can run on the mesh's devices."""
    check_attention(cfg.attention, mesh.devices.flat[0])
    shapes_only = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(shapes_only, nnx.Param)
    specs = nnx.to_pure_dict(param_specs(abstract_state, cfg.logical_axis_rules))
    abstract_params = nnx.to_pure_dict(abstract_state)
    check_divisible(abstract_params, specs, mesh_spec)
    return AbstractModel(
        graphdef, abstract_state, abstract_params, named_shardings(specs, mesh), config=cfg
    )


def merge_model(model: AbstractModel, params: Any) -> Transformer:
    """The nnx module whose parameters are `params` (a nested dict of arrays; usable inside jit)."""
    state = jax.tree.map(lambda leaf: leaf, model.abstract_state)  # a fresh copy to fill in
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(model.graphdef, state)
