"""The pipeline bubble measured in a profiler trace (training.profile=true with a pp axis).

Every tick of a pipeline schedule ends with its stages handing their activations on: one
collective-permute over `pp` per tick, inside the schedule's loop (and one per tick of the
loop's transpose, GPipe's and circular's backward pass). In the trace, the time between two
consecutive hand-overs on a device is one tick of that device's stage; the tick before the
first hand-over of a loop is not delimited, and is taken as the median of the others. Each
tick's time is then split by what the schedule ran in it (`idle_share`: 0 with a
micro-batch, 1 without, 1/2 for a 1F1B tick with only its forward or only its backward):

    bubble            idle tick time / tick time, over every stage and traced step
    bubble_of_step    idle tick time / step time (first to last operation of the step)
    pipeline_share    tick time / step time; the rest is the embedding, the loss and the update

With every tick equally long, `bubble` is the formula's; the measurement adds how long a tick
is, and how much of the step the pipeline's loops take.
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.observe.trace import op_events

# A device in op_events' keys: "device 3" (CPU threads) or "/device:GPU:3" (its own plane).
_ORDINAL = re.compile(r"(\d+)$")


def device_ordinal(device: str) -> int | None:
    """The local device number of an op_events key, if it names one."""
    match = _ORDINAL.search(device)
    return int(match.group(1)) if match else None


def _tick_times(ends: list[float], ticks: int, transposed: bool) -> list[tuple[int, float]]:
    """(tick, ns) of one run of a loop, from the end times of its `ticks` hand-overs."""
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    times = [statistics.median(gaps) if gaps else 0.0, *gaps]
    order = range(ticks - 1, -1, -1) if transposed else range(ticks)
    return list(zip(order, times, strict=True))


def measured_bubble(
    trace: Path,
    *,
    module: str,
    num_steps: int,
    ticks: int,
    hand_overs: dict[str, bool],
    stage_of: Callable[[int], int | None],
    idle_share: Callable[[int, int], float],
) -> dict[str, Any] | None:
    """The bubble of the traced steps, averaged over devices; None when the trace does not
    hold every hand-over of those steps. hand_overs: one collective-permute over pp per
    schedule loop, its HLO name → whether the loop runs backwards (a transpose: its first
    iteration is the last tick); stage_of(local device number) → the device's pp stage;
    idle_share(stage, tick) → the share of the tick that the stage spends without a
    micro-batch."""
    idle = busy = span = 0.0
    tick_ns: list[float] = []
    devices = 0
    for device, ops in op_events(trace, module).items():
        ordinal = device_ordinal(device)
        stage = None if ordinal is None else stage_of(ordinal)
        if stage is None:
            continue
        for name, transposed in hand_overs.items():
            ends = sorted(end for op, _, end in ops if op == name)
            if len(ends) != ticks * num_steps:
                return None
            for step in range(num_steps):
                run = ends[step * ticks : (step + 1) * ticks]
                for tick, ns in _tick_times(run, ticks, transposed):
                    idle += idle_share(stage, tick) * ns
                    busy += ns
                    tick_ns.append(ns)
        span += max(end for _, _, end in ops) - min(start for _, start, _ in ops)
        devices += 1
    if not devices or not busy:
        return None
    return {
        "devices": devices,
        "steps": num_steps,
        "tick_s": statistics.median(tick_ns) / 1e9,
        "bubble": idle / busy,
        "bubble_of_step": idle / span,
        "pipeline_share": busy / span,
    }
