"""What the compiled train step communicates: every collective in its HLO, how often it runs per
step, the mesh axes it spans and the bytes each device moves, against what an ideal lowering needs.

Bytes per device per execution, for a group of N devices and an array of S bytes (the full,
unsharded size), under a ring algorithm (as in NCCL and Horovod, https://arxiv.org/abs/1802.05799):

    all-gather, reduce-scatter   (N-1)/N · S
    all-reduce                   2(N-1)/N · S   (a reduce-scatter, then an all-gather)
    all-to-all                   (N-1)/N · S    (keeps 1/N, sends the rest)
    collective-permute           S              (to one peer)

The ideal equals the ring cost, except for an all-reduce whose every use keeps only this
device's 1/N slice: a reduce-scatter would do, at half the bytes. XLA's CPU backend lowers the
FSDP gradient reduce-scatter that way (all-reduce + dynamic-slice); GPU and TPU emit
reduce-scatter. The ideal also counts a payload at its own precision: XLA's CPU backend widens
bf16 and f16 collectives to f32 (a convert just before them), so a bf16 weight all-gather runs in
f32 on CPU, while GPU and TPU move it in bf16 (`payload_dtypes` names the narrower type).
Collectives inside a while loop (gradient accumulation's lax.scan) count once per
iteration, from the trip count XLA records for the loop.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from meshtrain.observe.hlo import (
    HloModule,
    Instruction,
    parse_module,
    replica_groups,
    source_target_pairs,
)
from meshtrain.observe.trace import collective_time
from meshtrain.units import format_bytes

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# These keep every element (layout and dtype may change): a slice after them slices the value.
_PASS_THROUGH = {"bitcast", "copy", "reshape", "convert", "all-reduce-done", "async-done"}
_SLICES = {"slice", "dynamic-slice"}


@dataclass
class Collective:
    """One collective instruction of the compiled step."""

    name: str  # the HLO instruction, e.g. "all-gather.17" (also its name in profiler traces)
    kind: str  # as compiled: one of KINDS
    dtypes: list[str]
    shapes: list[str]  # operand shapes, per device
    mesh_axes: list[str]  # the mesh axes its groups span
    whole_axes: bool  # false: each group is only part of those axes
    group_size: int
    count: float  # executions per step (a conditional's branch: a share, see observe.hlo)
    ring_bytes: float  # per device, per execution
    ideal_bytes: float
    ideal_kind: str  # the collective an ideal lowering would use
    payload_dtypes: list[str]  # the operands' dtypes before a backend widened them (see above)
    op_name: str  # where it comes from in the jax program
    trip_count_known: bool = True

    @property
    def ring_bytes_per_step(self) -> float:
        return self.ring_bytes * self.count

    @property
    def ideal_bytes_per_step(self) -> float:
        return self.ideal_bytes * self.count


def _mesh_axes(groups: np.ndarray, mesh: Mesh) -> tuple[list[str], bool]:
    """The mesh axes along which the devices of each group differ, and whether each group
    covers those axes entirely. groups: [num_groups, group_size] logical device ids, which index
    mesh.devices in row-major order (jit's device assignment is the mesh's flat device list)."""
    coords = np.stack(np.unravel_index(groups, mesh.devices.shape), axis=-1)  # [G, S, ndim]
    varying = [
        name for k, name in enumerate(mesh.axis_names) if (coords[..., k] != coords[:, :1, k]).any()
    ]
    span = math.prod(mesh.shape[name] for name in varying)
    return varying, groups.shape[1] == span


_NARROW_FLOATS = ("bf16", "f16")
_LAYOUT_ONLY = {"bitcast", "copy", "reshape", "transpose"}


def _operands(instruction: Instruction) -> list[str]:
    return instruction.operands[:1] if "permute" in instruction.opcode else instruction.operands


def _operand_arrays(module: HloModule, instruction: Instruction) -> list:
    return [array for name in _operands(instruction) for array in module.by_name[name].shape]


def _widened_from(module: HloModule, name: str) -> str | None:
    """The narrow float type that value `name` was converted to f32 from, when it is such a
    convert (or a fusion ending in one), possibly followed by layout changes; None otherwise."""
    producer = module.by_name[name]
    if producer.opcode == "fusion" and producer.callees:
        root = module.roots.get(producer.callees[0])
        producer = module.by_name[root] if root else producer
    while producer.opcode in _LAYOUT_ONLY and producer.operands:
        producer = module.by_name[producer.operands[0]]
    if producer.opcode != "convert" or [a.dtype for a in producer.shape] != ["f32"]:
        return None
    source = module.by_name.get(producer.operands[0]) if producer.operands else None
    dtypes = [a.dtype for a in source.shape] if source else []
    return dtypes[0] if len(dtypes) == 1 and dtypes[0] in _NARROW_FLOATS else None


def _payload_share(module: HloModule, instruction: Instruction) -> tuple[float, list[str]]:
    """The share of the operand bytes that holds data, and the operands' payload dtypes: a
    bf16 value widened to f32 for the collective carries half its bytes."""
    full = payload = 0.0
    dtypes = set()
    for name in _operands(instruction):
        narrow = _widened_from(module, name)
        for array in module.by_name[name].shape:
            full += array.bytes
            payload += array.bytes / 2 if narrow else array.bytes
            dtypes.add(narrow or array.dtype)
    return (payload / full if full else 1.0), sorted(dtypes)


def _used_share(
    module: HloModule, name: str, index: int | None, fusion: Instruction | None = None
) -> float | None:
    """The largest share of value `name` (its element `index`, for a tuple) that any use reads,
    when every use reads only a slice of it; None when some use needs all of it.

    Follows the value through layout changes and dtype converts, into fusions (`fusion`: the
    fusion whose fused computation `name` lives in) and out of them again.
    """
    largest = 0.0
    for user in module.users(name):
        share: float | None
        if user.opcode == "get-tuple-element":
            if index is not None and int(user.attribute("index") or -1) != index:
                continue
            share = _used_share(module, user.name, None, fusion)
        elif index is not None:
            return None  # the whole tuple is used, e.g. carried on by a loop
        elif user.opcode in _PASS_THROUGH:
            share = _used_share(module, user.name, None, fusion)
        elif user.opcode in _SLICES:
            whole = math.prod(module.by_name[name].shape[0].dims)
            share = math.prod(user.shape[0].dims) / max(whole, 1)
        elif user.opcode == "fusion" and user.callees:
            share = _fused_share(module, user, name)
        elif (
            user.opcode == "tuple"
            and fusion is not None
            and module.roots.get(user.computation) == user.name
        ):
            # Out of a multi-output fusion: element `position` of the fusion's result.
            share = _used_share(module, fusion.name, user.operands.index(name))
        else:
            return None
        if share is None:
            return None
        largest = max(largest, share)
    if fusion is not None and module.roots.get(module.by_name[name].computation) == name:
        share = _used_share(module, fusion.name, None)  # the fusion's result is this value
        if share is None:
            return None
        largest = max(largest, share)
    return largest or None


def _fused_share(module: HloModule, fusion: Instruction, operand: str) -> float | None:
    """_used_share of a fusion's operand: follows its parameter inside the fused computation."""
    largest = 0.0
    fused = module.computations.get(fusion.callees[0], [])
    for position, name in enumerate(fusion.operands):
        if name != operand:
            continue
        parameter = next(
            (i for i in fused if i.opcode == "parameter" and i.arguments.strip() == str(position)),
            None,
        )
        share = None if parameter is None else _used_share(module, parameter.name, None, fusion)
        if share is None:
            return None
        largest = max(largest, share)
    return largest or None


def _ideal_all_reduce(
    module: HloModule, instruction: Instruction, arrays: list, group_size: int
) -> tuple[float, str]:
    """Bytes and kind an ideal lowering needs for this all-reduce: a reduce-scatter for each
    element that every use slices down to 1/group_size."""
    n = group_size
    total, scattered = 0.0, False
    is_tuple = len(instruction.operands) > 1
    result = instruction.name
    if instruction.opcode == "all-reduce-start":
        done = [u for u in module.users(result) if u.opcode == "all-reduce-done"]
        result = done[0].name if done else result
    for index, array in enumerate(arrays):
        share = _used_share(module, result, index if is_tuple else None)
        if share is not None and share <= 1.0 / n + 1e-9:
            total += (n - 1) / n * array.bytes
            scattered = True
        else:
            total += 2 * (n - 1) / n * array.bytes
    return total, "reduce-scatter" if scattered else "all-reduce"


def _collective(
    module: HloModule, instruction: Instruction, mesh: Mesh, count: float, known: bool
) -> Collective:
    kind = instruction.opcode.removesuffix("-start")
    arrays = _operand_arrays(module, instruction)
    size = sum(array.bytes for array in arrays)
    if kind == "collective-permute":
        pairs = source_target_pairs(instruction)
        moving = pairs[pairs[:, 0] != pairs[:, 1]] if len(pairs) else pairs
        axes, whole = _mesh_axes(moving, mesh) if len(moving) else ([], True)
        n = 2 if len(moving) else 1
        ring = size * len(moving) / max(len(pairs), 1)
        ideal, ideal_kind = ring, kind
    else:
        groups = replica_groups(instruction, mesh.size)
        axes, whole = _mesh_axes(groups, mesh)
        n = groups.shape[1]
        if kind == "all-gather":
            ring = (n - 1) * size  # the operand is 1/n of the gathered array
        elif kind == "all-reduce":
            ring = 2 * (n - 1) / n * size
        else:  # reduce-scatter, all-to-all: the operand is the full array
            ring = (n - 1) / n * size
        ideal, ideal_kind = ring, kind
        if kind == "all-reduce" and n > 1:
            ideal, ideal_kind = _ideal_all_reduce(module, instruction, arrays, n)
    share, payload_dtypes = _payload_share(module, instruction)
    return Collective(
        name=instruction.name,
        kind=kind,
        dtypes=sorted({a.dtype for a in arrays}),
        shapes=[str(a) for a in arrays],
        mesh_axes=axes,
        whole_axes=whole,
        group_size=n,
        count=count,
        ring_bytes=ring,
        ideal_bytes=ideal * share,
        ideal_kind=ideal_kind,
        payload_dtypes=payload_dtypes,
        op_name=instruction.op_name,
        trip_count_known=known,
    )


@dataclass
class CommunicationReport:
    """Every collective of one compiled executable, per device per step."""

    module: str
    mesh: dict[str, int]
    collectives: list[Collective]
    measured: dict[str, Any] | None = field(default=None)  # from a profiler trace, if taken

    @property
    def ring_bytes_per_step(self) -> float:
        return sum(c.ring_bytes_per_step for c in self.collectives)

    @property
    def ideal_bytes_per_step(self) -> float:
        return sum(c.ideal_bytes_per_step for c in self.collectives)

    @property
    def names(self) -> set[str]:
        return {c.name for c in self.collectives}

    def summary(self) -> list[dict[str, Any]]:
        """One row per (kind, mesh axes, ideal kind), largest traffic first."""
        rows: dict[tuple, dict[str, Any]] = {}
        for c in self.collectives:
            axes = ",".join(c.mesh_axes) or "-"
            if not c.whole_axes:
                axes += " (part)"
            key = (c.kind, axes, c.ideal_kind)
            row = rows.setdefault(
                key,
                {
                    "kind": c.kind,
                    "mesh_axes": axes,
                    "ideal_kind": c.ideal_kind,
                    "dtypes": set(),
                    "payload_dtypes": set(),
                    "ops": 0,
                    "count_per_step": 0,
                    "ring_bytes_per_step": 0.0,
                    "ideal_bytes_per_step": 0.0,
                },
            )
            row["dtypes"].update(c.dtypes)
            row["payload_dtypes"].update(c.payload_dtypes)
            row["ops"] += 1
            row["count_per_step"] += c.count
            row["ring_bytes_per_step"] += c.ring_bytes_per_step
            row["ideal_bytes_per_step"] += c.ideal_bytes_per_step
        for row in rows.values():
            row["dtypes"] = sorted(row["dtypes"])
            row["payload_dtypes"] = sorted(row["payload_dtypes"])
        return sorted(rows.values(), key=lambda r: -r["ring_bytes_per_step"])

    def measure(self, trace: Path, num_steps: int) -> list[str]:
        """Adds the time the traced steps spent in collectives (meshtrain.trace); log lines."""
        self.measured = collective_time(
            trace, module=self.module, num_steps=num_steps, collectives=self.names
        )
        m = self.measured
        if m is None:
            return [f"profiler: the trace holds no operations of {self.module}"]
        kinds = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in m["by_kind_s_per_step"].items())
        return [
            f"profiler: collectives took {m['collective_share']:.1%} of the step time "
            f"({m['collective_s_per_step'] * 1e3:.2f} ms of {m['step_time_s'] * 1e3:.2f} ms per "
            f"step, mean of {m['devices']} devices over {m['steps']} steps); "
            f"{m['overlapped_share']:.1%} of it overlapped compute, "
            f"{m['exposed_collective_share']:.1%} of the step was exposed communication",
            f"profiler: time in collectives per step: {kinds or 'none'}",
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "mesh": self.mesh,
            "bytes_per_device_per_step": {
                "ring": self.ring_bytes_per_step,
                "ideal": self.ideal_bytes_per_step,
            },
            "summary": self.summary(),
            "collectives": [
                {
                    **asdict(c),
                    "ring_bytes_per_step": c.ring_bytes_per_step,
                    "ideal_bytes_per_step": c.ideal_bytes_per_step,
                }
                for c in self.collectives
            ],
            "measured": self.measured,
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    def format(self) -> list[str]:
        """The report as log lines: a table by kind and mesh axes, then the totals."""
        header = f"{'collective':<19}{'mesh axes':<20}{'dtype':<9}{'per step':>9}{'ring bytes':>14}{'ideal bytes':>14}"
        lines = [
            f"communication per device per step, from the compiled HLO ({self.module}):",
            header,
        ]
        for row in self.summary():
            ideal = []
            if row["ideal_kind"] != row["kind"]:
                ideal.append(row["ideal_kind"])
            if row["payload_dtypes"] != row["dtypes"]:
                ideal.append(f"{'+'.join(row['payload_dtypes'])} payload, widened by the backend")
            note = f"  ideal: {', '.join(ideal)}" if ideal else ""
            lines.append(
                f"{row['kind']:<19}{row['mesh_axes']:<20}{'+'.join(row['dtypes']):<9}"
                f"{row['count_per_step']:>9g}{format_bytes(row['ring_bytes_per_step']):>14}"
                f"{format_bytes(row['ideal_bytes_per_step']):>14}{note}"
            )
        lines.append(
            f"{'total':<48}{sum(c.count for c in self.collectives):>9g}"
            f"{format_bytes(self.ring_bytes_per_step):>14}{format_bytes(self.ideal_bytes_per_step):>14}"
        )
        if any(not c.trip_count_known for c in self.collectives):
            lines.append("note: some collectives sit in a loop of unknown trip count, counted once")
        return lines


def account_collectives(hlo_text: str, mesh: Mesh) -> CommunicationReport:
    """The collectives of a compiled executable (`compiled.as_text()`) laid out on `mesh`."""
    module = parse_module(hlo_text)
    counts, unknown = module.execution_counts()
    collectives = []
    for computation, instructions in module.computations.items():
        count = counts.get(computation, 0)
        for instruction in instructions:
            if instruction.opcode.removesuffix("-start") in KINDS and count:
                collectives.append(
                    _collective(module, instruction, mesh, count, computation not in unknown)
                )
    return CommunicationReport(
        module=module.name,
        mesh={name: int(size) for name, size in mesh.shape.items()},
        collectives=collectives,
    )
