"""Reads a JAX profiler trace (`*.xplane.pb`) offline: per device, how much of the traced steps
went to collectives, and how much of that time compute ran at the same time.

Every XLA operation the runtime executes appears as an event carrying an `hlo_op` stat (its HLO
instruction name) and an `hlo_module` stat. On GPU and TPU the events sit on the device's own
plane (`/device:GPU:0`...); on CPU they sit on the host's thread lines with a `device_ordinal`
stat. jax's own `ProfileData` parses the file, so nothing beyond jaxlib is needed.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

_COLLECTIVE_OP = re.compile(
    r"^(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(-start|-done)?(\.\d+)?$"
)
Intervals = list[tuple[float, float]]


def find_trace(profile_dir: Path) -> Path | None:
    """The newest `*.xplane.pb` that jax.profiler wrote under profile_dir, if any."""
    traces = sorted(
        Path(profile_dir).glob("plugins/profile/*/*.xplane.pb"), key=lambda p: p.stat().st_mtime
    )
    return traces[-1] if traces else None


def _union(intervals: Intervals) -> Intervals:
    merged: Intervals = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: Intervals, b: Intervals) -> float:
    """Total length of the overlap of two merged, sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _kind(op: str) -> str:
    match = _COLLECTIVE_OP.match(op)
    return match.group(1) if match else op.rsplit(".", 1)[0]


def _events(trace: Path) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(plane name, event, its stats as a dict) of every event in the trace. jaxlib's
    `event_stats` type has no __module__, which Python 3.12 warns about (DeprecationWarning)
    when the type is first used: a fault of jaxlib's bindings, not of this code, so hidden."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "builtin type event_stats", DeprecationWarning)
        for plane in jax.profiler.ProfileData.from_file(str(trace)).planes:
            for line in plane.lines:
                for event in line.events:
                    yield plane.name, event, dict(event.stats)


def op_events(trace: Path, module: str) -> dict[str, list[tuple[str, float, float]]]:
    """Per device: (hlo_op, start_ns, end_ns) of every operation of `module` in the trace."""
    events: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    for plane, event, stats in _events(trace):
        op = stats.get("hlo_op")
        if op is None or stats.get("hlo_module", module) != module:
            continue
        device = (
            plane if plane.startswith("/device:") else f"device {stats.get('device_ordinal', '?')}"
        )
        events[device].append((str(op), event.start_ns, event.end_ns))
    return dict(events)


def step_annotations(trace: Path) -> list[int]:
    """The step numbers of the StepTraceAnnotation events in the trace, in order."""
    steps = [
        (event.start_ns, int(stats["step_num"]))
        for _, event, stats in _events(trace)
        if "step_num" in stats
    ]
    return [step for _, step in sorted(steps)]


def collective_time(
    trace: Path, *, module: str, num_steps: int, collectives: set[str] = frozenset()
) -> dict[str, Any] | None:
    """Measured time in collectives per step, averaged over devices, and the share of it that
    overlapped compute; None when the trace holds no operations of `module`.

    A device's step time is the span from its first to its last operation in the trace, divided
    by the traced steps. An operation is a collective when its HLO name is in `collectives` or
    is spelled like one (all-gather.3, all-reduce-start.1...); everything else is compute.
    """
    per_device = op_events(trace, module)
    if not per_device:
        return None
    span = collective = overlap = 0.0
    by_kind: dict[str, float] = defaultdict(float)
    for ops in per_device.values():
        is_collective = [op in collectives or bool(_COLLECTIVE_OP.match(op)) for op, _, _ in ops]
        comm = _union([(s, e) for (_, s, e), c in zip(ops, is_collective, strict=True) if c])
        compute = _union([(s, e) for (_, s, e), c in zip(ops, is_collective, strict=True) if not c])
        span += max(e for _, _, e in ops) - min(s for _, s, _ in ops)
        collective += _length(comm)
        overlap += _intersection(comm, compute)
        for (op, start, end), c in zip(ops, is_collective, strict=True):
            if c:
                by_kind[_kind(op)] += end - start
    devices, ns = len(per_device), 1e9
    step_time = span / devices / num_steps / ns
    collective_per_step = collective / devices / num_steps / ns
    return {
        "devices": devices,
        "steps": num_steps,
        "step_time_s": step_time,
        "collective_s_per_step": collective_per_step,
        "collective_share": collective_per_step / step_time if step_time else 0.0,
        "overlapped_share": overlap / collective if collective else 0.0,
        "exposed_collective_share": (collective - overlap) / devices / num_steps / ns / step_time
        if step_time
        else 0.0,
        "by_kind_s_per_step": {
            kind: total / devices / num_steps / ns for kind, total in sorted(by_kind.items())
        },
    }
