"""The model before it exists: its structure, shapes and shardings, from an abstract init.

`abstract_model` runs the model's constructor under `nnx.eval_shape` (nothing is allocated) and
maps each parameter's logical axes through the rule table to a NamedSharding, checking that every
sharded dimension divides. Training creates its state from it, loaders read weights into its
shardings, and `merge_model` turns a tree of arrays back into a callable module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshtrain.config.lora import lora_enabled
from meshtrain.config.model_mesh import check_model_on_mesh
from meshtrain.config.schema import ModelConfig
from meshtrain.models.attention_choice import check_attention
from meshtrain.models.frozen import check_quant_blocks, frozen_layout
from meshtrain.models.lora import join_adapters, split_adapters
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.context import sequence_shards
from meshtrain.parallel.mesh import MeshSpec
from meshtrain.parallel.rules import (
    check_divisible,
    mesh_axes_for,
    named_shardings,
    param_specs,
    rules_without,
)


@dataclass(frozen=True)
class AbstractModel:
    """The model's structure and where each array lives, known before anything is allocated."""

    graphdef: nnx.GraphDef
    abstract_state: nnx.State  # nnx.Param variables holding ShapeDtypeStructs
    abstract_params: Any  # the same as a nested dict of ShapeDtypeStruct
    param_shardings: Any  # nested dict of NamedSharding
    config: ModelConfig | None = None  # what it was built from
    # LoRA (model.lora): the frozen base as stored (models.frozen), ShapeDtypeStructs and
    # shardings; None without LoRA.
    frozen_params: Any = None
    frozen_shardings: Any = None

    @property
    def lora(self) -> bool:
        """Whether only LoRA adapters train, on a frozen base."""
        return self.config is not None and lora_enabled(self.config)

    @property
    def trainable_params(self) -> Any:
        """The parameters that train: the adapters with LoRA, else every parameter."""
        return split_adapters(self.abstract_params)[0] if self.lora else self.abstract_params

    @property
    def trainable_shardings(self) -> Any:
        return split_adapters(self.param_shardings)[0] if self.lora else self.param_shardings

    @property
    def base_params(self) -> Any:
        """The parameters a checkpoint or Hugging Face directory provides: all but adapters."""
        return split_adapters(self.abstract_params)[1] if self.lora else self.abstract_params

    @property
    def base_shardings(self) -> Any:
        return split_adapters(self.param_shardings)[1] if self.lora else self.param_shardings

    def full_params(self, trainable: Any, frozen: Any = None) -> Any:
        """Every parameter of the model: the trainable ones joined with the frozen base."""
        return join_adapters(trainable, frozen) if self.lora else trainable


def key_value_replicas(cfg: ModelConfig, mesh_spec: MeshSpec) -> int:
    """The ranks that each hold `cfg`'s key/value projections whole: the size of the mesh axes
    of `kv_heads` (tp) when they do not divide model.num_kv_heads, else 1 (split over them)."""
    shards = mesh_spec.size(*mesh_axes_for("kv_heads", cfg.logical_axis_rules))
    return 1 if cfg.num_kv_heads % shards == 0 else shards


def replicated_kv_heads(cfg: ModelConfig, mesh_spec: MeshSpec) -> str | None:
    """Why `cfg`'s key/value heads are replicated on this mesh (a log line), or None when the
    mesh axes of `kv_heads` (tp) divide model.num_kv_heads. Gemma 3 1B has 1 key/value head;
    Llama 3 8B has 8, for 16 tp ranks on two 8-GPU nodes."""
    shards = key_value_replicas(cfg, mesh_spec)
    if shards == 1:
        return None
    rules = cfg.logical_axis_rules
    names = "×".join(mesh_axes_for("kv_heads", rules))
    per_rank = cfg.num_heads // mesh_spec.size(*mesh_axes_for("heads", rules))
    return (
        f"{names}={shards} does not divide model.num_kv_heads={cfg.num_kv_heads}: the key/value "
        f"projections are replicated over {names}, and each rank repeats the key/value heads "
        f"its {per_rank} query heads read"
    )


def fit_kv_heads(cfg: ModelConfig, mesh_spec: MeshSpec) -> ModelConfig:
    """`cfg`, with its key/value heads replicated when the mesh cannot split them
    (replicated_kv_heads): the key and value projections are then whole on every tp rank, and
    each rank repeats the key/value heads its query heads read (models.layers.Attention). Query
    heads, the MLP and the vocabulary stay sharded."""
    if replicated_kv_heads(cfg, mesh_spec) is None:
        return cfg
    return dataclasses.replace(cfg, logical_axis_rules={**cfg.logical_axis_rules, "kv_heads": None})


def whole_stacked_layers(cfg: ModelConfig, mesh_spec: MeshSpec) -> str | None:
    """Why every pipeline stage stores all the stacked blocks (a log line), or None when the
    mesh axes of `layers` (pp) divide model.num_layers, as they must unless
    model.pipeline.layers_per_stage sets uneven stages (Gemma 3 1B's 26 layers on pp=4)."""
    stages = mesh_spec.size(*mesh_axes_for("layers", cfg.logical_axis_rules))
    if not cfg.scan_layers or cfg.num_layers % stages == 0:
        return None
    return (
        f"pp={stages} does not divide model.num_layers={cfg.num_layers}: every stage stores "
        "all the stacked blocks (sharded over the other axes as without pp) and runs the "
        f"layers of model.pipeline.layers_per_stage={cfg.pipeline.layers_per_stage}"
    )


def abstract_model(
    cfg: ModelConfig, mesh: Mesh, mesh_spec: MeshSpec, compute_dtype: Any = jnp.float32
) -> AbstractModel:
    """Abstract init (shapes only) plus the logical rules → shardings; checks that the heads,
    MLP and vocabulary divide over the mesh (one line naming the sizes that would work), even
    division of every parameter, and that model.attention can run on the mesh's devices.
    Key/value heads that the mesh cannot split are replicated (fit_kv_heads), and so are the
    stacked blocks over stages that do not divide them (whole_stacked_layers). With LoRA, the
    frozen base's storage at `compute_dtype` (models.frozen; checked against its blocks)."""
    check_attention(
        cfg.attention,
        mesh.devices.flat[0],
        sequence_shards(mesh_spec.sizes, cfg.logical_axis_rules),
    )
    check_model_on_mesh(cfg, mesh_spec)
    cfg = fit_kv_heads(cfg, mesh_spec)
    if whole_stacked_layers(cfg, mesh_spec):
        cfg = dataclasses.replace(
            cfg, logical_axis_rules={**cfg.logical_axis_rules, "layers": None}
        )
    shapes_only = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(shapes_only, nnx.Param)
    specs = nnx.to_pure_dict(param_specs(abstract_state, cfg.logical_axis_rules))
    abstract_params = nnx.to_pure_dict(abstract_state)
    check_divisible(abstract_params, specs, mesh_spec)
    model = AbstractModel(
        graphdef, abstract_state, abstract_params, named_shardings(specs, mesh), config=cfg
    )
    if not model.lora:
        return model
    check_quant_blocks(model.base_params, cfg)
    frozen, frozen_shardings = frozen_layout(
        model.base_params, model.base_shardings, cfg, compute_dtype
    )
    return dataclasses.replace(model, frozen_params=frozen, frozen_shardings=frozen_shardings)


def merge_model(model: AbstractModel, params: Any) -> Transformer:
    """The nnx module whose parameters are `params` (a nested dict of arrays; usable inside jit)."""
    state = jax.tree.map(lambda leaf: leaf, model.abstract_state)  # a fresh copy to fill in
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(model.graphdef, state)


def without_mesh_axes(model: AbstractModel, axes: tuple[str, ...]) -> AbstractModel:
    """`model` with `axes` taken out of every rule its layers constrain with: the same
    parameters and shardings, for a forward and backward pass run once per device group of
    `axes` (jax.vmap with spmd_axis_name=axes, as train.gradients does), where the batch is
    split over the remaining batch axes and each group's gradients are whole along `axes`."""
    cfg = model.config
    cfg = dataclasses.replace(cfg, logical_axis_rules=rules_without(cfg.logical_axis_rules, axes))
    module = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    module.gather_table = True
    graphdef, abstract_state = nnx.split(module, nnx.Param)
    return dataclasses.replace(model, graphdef=graphdef, abstract_state=abstract_state, config=cfg)
