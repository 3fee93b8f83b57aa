"""Turns `model.mesh_shape` into a JAX device mesh, with errors that say what to type instead.

The mesh always has every known axis, in a fixed order with `tp` innermost (the devices that
`jax.make_mesh` places next to each other, i.e. with the fastest links). Axes the user leaves out
have size 1, so the logical rules may name any of them. Across GPU or CPU hosts, tp stays within
a host and fsdp and dp span hosts.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from meshtrain.errors import ConfigError

# Outermost to innermost: replicas, pipeline stages, parameter shards, expert shards (a mixture
# of experts' experts; the batch is split over them too), sequence (context parallel) shards,
# tensor parallel.
MESH_AXES: tuple[str, ...] = ("dp", "pp", "fsdp", "ep", "cp", "tp")


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


def _fake_devices_hint(used: int, num_devices: int, platform: str | None, training: bool) -> str:
    """How to fake the CPU devices a mesh needs, for an error about too few of them; else ""
    (plan.fake_devices is a training key: a loaded model's command has only XLA's flag)."""
    if platform != "cpu" or used <= num_devices:
        return ""
    key = f" or plan.fake_devices={used}" if training else ""
    return (
        f"; on a CPU, fake {used} devices with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={used}{key}"
    )


def parse_mesh_shape(
    mesh_shape: Any, num_devices: int, platform: str | None = None, *, training: bool = True
) -> MeshSpec:
    """Validates `model.mesh_shape` ([[sizes], [names]]) against the visible device count;
    `platform` (the devices' jax platform, "cpu") adds how to fake CPU devices to the error,
    with plan.fake_devices for a training run (`training`)."""
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
            f"{_fake_devices_hint(used, num_devices, platform, training)}"
        )
    given = dict(zip(names, sizes, strict=True))
    return MeshSpec({axis: given.get(axis, 1) for axis in MESH_AXES})


def build_mesh(
    spec: MeshSpec,
    devices: Sequence[jax.Device] | None = None,
    hosts: Sequence[str] | None = None,
) -> Mesh:
    """The device mesh with every axis of MESH_AXES, `tp` innermost, all axes in Auto mode.

    Auto axes let XLA propagate shardings from the parameters and our activation constraints;
    Explicit axes would need an `out_sharding` at every contraction over a sharded dimension.
    With several GPU or CPU processes, `hosts` (the host name of each process) keeps `tp` within
    a host, see devices_by_host.
    """
    devices = list(jax.devices() if devices is None else devices)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    processes = sorted({d.process_index for d in devices})
    if len(processes) > 1 and devices[0].platform != "tpu":
        hosts = list(hosts) if hosts is not None else [str(p) for p in range(processes[-1] + 1)]
        return Mesh(devices_by_host(spec, devices, hosts), MESH_AXES, axis_types=axis_types)
    # TPU hosts of a slice share the inter-chip links: jax.make_mesh follows that topology.
    return jax.make_mesh(spec.shape, MESH_AXES, axis_types=axis_types, devices=devices)


def devices_by_host(
    spec: MeshSpec, devices: Sequence[jax.Device], hosts: Sequence[str]
) -> np.ndarray:
    """Devices as an array of shape spec.shape ([dp, pp, fsdp, tp]): host after host, within a
    host process after process, in row-major order.

    `hosts[p]` names the machine of process p. So each tp group (innermost) lies on one host, on
    its fast links, while fsdp, pp and dp span hosts; and each process holds one contiguous block
    of the batch (dp × fsdp) positions of its pipeline stage, which it reads itself.
    """
    first_seen = {host: rank for rank, host in reversed(list(enumerate(hosts)))}
    per_host = Counter(hosts[d.process_index] for d in devices)
    counts = sorted(set(per_host.values()))
    shown = format_mesh_shape(spec.shape, MESH_AXES)
    if len(counts) > 1:
        raise ConfigError(
            f"model.mesh_shape {shown}: the hosts have different numbers of devices "
            f"({', '.join(str(c) for c in counts)}); give every host the same number"
        )
    local, tp = counts[0], spec.sizes["tp"]
    if local % tp:
        options = ", ".join(str(d) for d in range(1, local + 1) if local % d == 0)
        raise ConfigError(
            f"model.mesh_shape {shown}: tp={tp} does not divide the {local} devices of each of the "
            f"{len(per_host)} hosts, so tp groups would span hosts; tp stays within a host (its "
            f"fast links): use tp in {{{options}}} and put the rest on fsdp or dp"
        )
    ordered = sorted(
        devices, key=lambda d: (first_seen[hosts[d.process_index]], d.process_index, d.id)
    )
    return np.array(ordered, dtype=object).reshape(spec.shape)


def resolve_mesh(mesh: Mesh | Any | None) -> tuple[Mesh, MeshSpec]:
    """The mesh a model is loaded onto outside training: None (the first device, no sharding),
    a mesh_shape such as [[4,2],["fsdp","tp"]] over all visible devices, or a Mesh from
    build_mesh."""
    if mesh is None:
        spec = parse_mesh_shape([[1, 1], ["fsdp", "tp"]], 1)
        return build_mesh(spec, jax.devices()[:1]), spec
    if isinstance(mesh, Mesh):
        if set(mesh.axis_names) != set(MESH_AXES):
            raise ValueError(
                f"mesh axes {mesh.axis_names} are not meshtrain's {MESH_AXES}; pass a "
                'mesh_shape like [[4,2],["fsdp","tp"]] instead'
            )
        return mesh, MeshSpec({axis: mesh.shape[axis] for axis in MESH_AXES})
    devices = jax.devices()
    spec = parse_mesh_shape(mesh, len(devices), platform=devices[0].platform, training=False)
    return build_mesh(spec), spec
