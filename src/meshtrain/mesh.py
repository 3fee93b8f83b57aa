"""Turns `model.mesh_shape` into a JAX device mesh, with errors that say what to type instead.

The mesh always has every known axis, in a fixed order with `tp` innermost (the devices that
`jax.make_mesh` places next to each other, i.e. with the fastest links). Axes the user leaves out
have size 1, so the logical rules may name any of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from meshtrain.errors import ConfigError

# Outermost to innermost. `pp` (pipeline stages) will slot in between dp and fsdp.
MESH_AXES: tuple[str, ...] = ("dp", "fsdp", "tp")
RESERVED_AXES: dict[str, str] = {"pp": "pipeline parallelism is not supported yet"}


@dataclass(frozen=True)
class MeshSpec:
    """A validated mesh shape: one size per axis of MESH_AXES."""

    sizes: dict[str, int]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[axis] for axis in MESH_AXES)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def size(self, *axes: str) -> int:
        return math.prod(self.sizes[axis] for axis in axes)


def format_mesh_shape(sizes: Sequence[Any], names: Sequence[Any]) -> str:
    return f"[[{','.join(str(s) for s in sizes)}],[{','.join(str(n) for n in names)}]]"


def _devices(count: int) -> str:
    return f"{count} device" if count == 1 else f"{count} devices"


def _suggestions(num_devices: int, names: Sequence[str]) -> str:
    """Two mesh shapes over `names` that use exactly num_devices devices."""
    if "tp" in names and "fsdp" in names:
        options = [{"fsdp": num_devices, "tp": 1}]
        if num_devices % 2 == 0 and num_devices > 1:
            options.append({"fsdp": num_devices // 2, "tp": 2})
    else:
        options = [{name: num_devices if i == 0 else 1 for i, name in enumerate(names)}]
    shapes = [format_mesh_shape([o.get(n, 1) for n in names], names) for o in options]
    minus_one = format_mesh_shape([-1] + [1] * (len(names) - 1), names)
    return " or ".join(shapes) + f", or -1 for one size (e.g. {minus_one})"


def parse_mesh_shape(mesh_shape: Any, num_devices: int) -> MeshSpec:
    """Validates `model.mesh_shape` ([[sizes], [names]]) against the visible device count."""
    if (
        not isinstance(mesh_shape, Sequence)
        or isinstance(mesh_shape, str)
        or len(mesh_shape) != 2
        or not all(isinstance(part, Sequence) and not isinstance(part, str) for part in mesh_shape)
    ):
        raise ConfigError(
            f"model.mesh_shape={mesh_shape!r} is not [[sizes],[names]]; "
            'write it like \'model.mesh_shape=[[4,2],["fsdp","tp"]]\''
        )
    sizes, names = list(mesh_shape[0]), [str(n) for n in mesh_shape[1]]
    shown = format_mesh_shape(sizes, names)
    if len(sizes) != len(names):
        raise ConfigError(
            f"model.mesh_shape {shown} has {len(sizes)} sizes but {len(names)} axis names; "
            f"give one size per name, e.g. {format_mesh_shape([num_devices, 1], ['fsdp', 'tp'])}"
        )
    for name in names:
        if name in RESERVED_AXES:
            raise ConfigError(
                f"model.mesh_shape {shown}: axis '{name}' is reserved ({RESERVED_AXES[name]}); "
                f"use the axes {', '.join(MESH_AXES)}"
            )
        if name not in MESH_AXES:
            raise ConfigError(
                f"model.mesh_shape {shown}: unknown axis '{name}'; "
                f"known axes are {', '.join(MESH_AXES)}, e.g. {format_mesh_shape([num_devices, 1], ['fsdp', 'tp'])}"
            )
    if len(set(names)) != len(names):
        raise ConfigError(f"model.mesh_shape {shown} names an axis twice; name each axis once")
    if not all(
        isinstance(s, int) and not isinstance(s, bool) and (s >= 1 or s == -1) for s in sizes
    ):
        raise ConfigError(
            f"model.mesh_shape {shown}: sizes must be positive integers or one -1; "
            f"e.g. {format_mesh_shape([num_devices, 1], ['fsdp', 'tp'])}"
        )
    if sizes.count(-1) > 1:
        raise ConfigError(f"model.mesh_shape {shown} has more than one -1; only one size may be -1")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if num_devices % known:
            raise ConfigError(
                f"model.mesh_shape {shown}: the other sizes multiply to {known}, which does not "
                f"divide the {num_devices} visible devices; use {_suggestions(num_devices, names)}"
            )
        sizes[sizes.index(-1)] = num_devices // known
    used = math.prod(sizes)
    if used != num_devices:
        raise ConfigError(
            f"model.mesh_shape {shown} uses {_devices(used)} but {num_devices} "
            f"{'is' if num_devices == 1 else 'are'} visible; "
            f"use {_suggestions(num_devices, names)}"
        )
    given = dict(zip(names, sizes, strict=True))
    return MeshSpec({axis: given.get(axis, 1) for axis in MESH_AXES})


def build_mesh(spec: MeshSpec, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The device mesh with every axis of MESH_AXES, `tp` innermost, all axes in Auto mode.

    Auto axes let XLA propagate shardings from the parameters and our activation constraints;
    Explicit axes would need an `out_sharding` at every contraction over a sharded dimension.
    """
    return jax.make_mesh(
        spec.shape,
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )
