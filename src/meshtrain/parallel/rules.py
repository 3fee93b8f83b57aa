"""Maps logical axis names to mesh axes through the one rule table in `model.logical_axis_rules`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.parallel.mesh import MESH_AXES, MeshSpec

LogicalAxes = Sequence[str | None]
Rules = Mapping[str, Any]


def check_rules(rules: Rules) -> None:
    """Every rule maps to known mesh axes (a name, a list of names, or null)."""
    for logical, target in rules.items():
        targets = [] if target is None else [target] if isinstance(target, str) else list(target)
        for axis in targets:
            if axis not in MESH_AXES:
                raise ConfigError(
                    f"model.logical_axis_rules.{logical}={target!r} names unknown mesh axis "
                    f"'{axis}'; use one of {', '.join(MESH_AXES)} or null"
                )


def active_axes(axes: Sequence[str], mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """Those of the mesh axes `axes` that split anything in a mesh of `mesh_shape`: size > 1
    (an axis the mesh lacks has size 1)."""
    return tuple(a for a in axes if mesh_shape.get(a, 1) > 1)


def mesh_axes_for(logical: str | None, rules: Rules) -> tuple[str, ...]:
    """The mesh axes a logical axis is sharded over (empty: replicated)."""
    if logical is None:
        return ()
    if logical not in rules:
        raise ConfigError(
            f"model.logical_axis_rules has no rule for logical axis '{logical}'; "
            f"add e.g. model.logical_axis_rules.{logical}=null"
        )
    target = rules[logical]
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def logical_to_spec(logical_axes: LogicalAxes, rules: Rules) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry these logical names.

    A mesh axis shards at most one dimension; if two logical axes map to the same mesh
    axis, the first dimension keeps it and the later one is replicated along it.
    """
    used: set[str] = set()
    entries = []
    for logical in logical_axes:
        axes = tuple(a for a in mesh_axes_for(logical, rules) if a not in used)
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def constrain(x: jax.Array, logical_axes: LogicalAxes, rules: Rules) -> jax.Array:
    """Sharding constraint on an activation, under the mesh set by `jax.set_mesh`.

    A no-op outside a mesh context (e.g. a model called eagerly in a notebook). A dimension
    its mesh axes do not divide (one sequence of inference on an fsdp=8 mesh) is left to XLA:
    constrained, it would be padded to one row per device, every device computing it whole.
    Inside a shard_map manual over every mesh axis (a mixture of experts' expert parallel
    layer), where each device holds its own block, a no-op too.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or set(mesh.manual_axes) == set(mesh.axis_names):
        return x
    entries = []
    for dim, entry in zip(x.shape, logical_to_spec(logical_axes, rules), strict=False):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        divides = dim % math.prod(mesh.shape[a] for a in axes) == 0
        entries.append(entry if divides else PartitionSpec.UNCONSTRAINED)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*entries))


def param_specs(abstract_state: nnx.State, rules: Rules) -> Any:
    """PartitionSpec per parameter, from the `logical_axes` metadata each nnx.Param carries."""

    def spec(variable: nnx.Variable) -> PartitionSpec:
        logical = variable.get_metadata().get("logical_axes")
        if logical is None:
            raise ValueError(f"parameter of shape {variable.shape} carries no logical_axes")
        return logical_to_spec(logical, rules)

    return jax.tree.map(spec, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def named_shardings(specs: Any, mesh: Mesh) -> Any:
    """NamedShardings on `mesh` of PartitionSpecs, written without the mesh's axes of size 1
    (the same layout: P("fsdp", "tp") for a rule ["fsdp", "cp"] on a mesh without cp)."""
    unit = [a for a in mesh.axis_names if mesh.shape[a] == 1]
    return jax.tree.map(
        lambda s: NamedSharding(mesh, without_axes(s, unit)),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def check_divisible(abstract_params: Any, specs: Any, mesh_spec: MeshSpec) -> None:
    """Each sharded dimension divides evenly over its mesh axes (uneven shards waste memory and time)."""
    flat_params = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, leaf), spec in zip(flat_params, flat_specs, strict=True):
        for dim, entry in zip(leaf.shape, spec, strict=False):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            shards = mesh_spec.size(*axes)
            if dim % shards:
                name = jax.tree_util.keystr(path, simple=True, separator=".")
                raise ConfigError(
                    f"parameter {name} has a dimension of {dim} sharded over "
                    f"{'×'.join(axes)}={shards}, which does not divide it; change "
                    "model.mesh_shape or the model size so that it divides"
                )


def rules_without(rules: Rules, axes: Sequence[str]) -> dict[str, Any]:
    """`rules` with the mesh axes `axes` taken out of every rule (null where none is left)."""
    return {
        logical: [a for a in mesh_axes_for(logical, rules) if a not in axes] or None
        for logical in rules
    }


def without_axes(spec: PartitionSpec, axes: Sequence[str]) -> PartitionSpec:
    """`spec` with the mesh axes `axes` taken out: the layout of an array whole along them."""
    entries = []
    for entry in spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(a for a in names if a not in axes)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)
