"""What a pipeline run does, before anything is traced: the stages, micro-batches, repeats and
schedule of a `pp` mesh axis (PipelinePlan: ticks, bubble, activations alive, the start-up
line and plan.json's entry), and which layer each stage runs in each slot (layer_table).
train.pipeline runs it; measure_bubble reads its bubble from a profiler trace."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from meshtrain.config.pipeline import pipeline_microbatches, pipeline_repeats, stage_layer_counts
from meshtrain.config.schema import Config
from meshtrain.observe.bubble import measured_bubble
from meshtrain.observe.communication import CommunicationReport
from meshtrain.parallel.mesh import MeshSpec

AXIS = "pp"


@dataclass(frozen=True)
class PipelinePlan:
    """S stages, M pipeline micro-batches per micro-batch, and the schedule that runs them."""

    stages: int
    microbatches: int
    schedule: str  # PipelineSchedule
    repeats: int = 1  # circular: chunks of layers per stage
    layers_per_stage: tuple[int, ...] = ()  # uneven stages; empty: num_layers / stages each

    @property
    def ticks(self) -> int:
        """Ticks of the schedule's loop: R·M + S - 1 forwards (gpipe, circular: R = 1 for
        gpipe), whose backward is as many; M + 2(S - 1) of a forward and a backward (1f1b)."""
        if self.schedule == "1f1b":
            return self.microbatches + 2 * (self.stages - 1)
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def idle_ticks(self) -> int:
        """Ticks of the loop at which a stage has no micro-batch: S - 1, or 2(S - 1) for 1f1b
        (counting each of its forward and backward halves as half a tick)."""
        return (2 if self.schedule == "1f1b" else 1) * (self.stages - 1)

    @property
    def bubble(self) -> float:
        """Share of a stage's ticks without a micro-batch, by the formula (`formula`)."""
        return self.idle_ticks / self.ticks

    def idle_share(self, stage: int, tick: int) -> float:
        """The share of tick `tick` that stage `stage` spends without a micro-batch: 1 or 0,
        or for 1f1b half for each of its forward and backward that has none."""
        count = self.microbatches
        if self.schedule == "1f1b":
            forward, backward = tick - stage, tick - 2 * (self.stages - 1) + stage
            return (2 - (0 <= forward < count) - (0 <= backward < count)) / 2
        return float(not 0 <= tick - stage < self.repeats * count)

    @property
    def formula(self) -> str:
        return {
            "1f1b": "2(S-1)/(M+2(S-1))",
            "circular": "(S-1)/(R·M+S-1)",
        }.get(self.schedule, "(S-1)/(M+S-1)")

    @property
    def microbatches_alive(self) -> int:
        """Pipeline micro-batches whose activations a stage holds at once, at most: gpipe and
        circular keep every one for the backward pass; 1f1b the inputs of those between forward
        and backward."""
        if self.schedule == "1f1b":
            return min(self.microbatches, 2 * self.stages - 1)
        return self.microbatches

    def to_json(self) -> dict[str, Any]:
        """plan.json's `pipeline` entry."""
        return {
            "stages": self.stages,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "repeats": self.repeats,
            "layers_per_stage": list(self.layers_per_stage) or None,
            "ticks": self.ticks,
            "bubble": self.bubble,
            "microbatches_alive": self.microbatches_alive,
        }

    def describe(self) -> str:
        repeats = f" × {self.repeats} repeats" if self.schedule == "circular" else ""
        layers = (
            f"; layers per stage {list(self.layers_per_stage)}" if self.layers_per_stage else ""
        )
        return (
            f"pipeline: {self.stages} stages, {self.microbatches} micro-batches, "
            f"{self.schedule}{repeats}: bubble {self.bubble:.1%} ({self.formula}), activations "
            f"of {self.microbatches_alive} micro-batch(es) alive per stage{layers}"
        )


def pipeline_plan(cfg: Config, mesh: MeshSpec) -> PipelinePlan | None:
    """The run's pipeline, or None without a pp axis of size > 1."""
    if mesh.sizes["pp"] == 1:
        return None
    counts = stage_layer_counts(cfg, mesh)
    return PipelinePlan(
        mesh.sizes["pp"],
        pipeline_microbatches(cfg, mesh),
        cfg.training.pipeline.schedule,
        pipeline_repeats(cfg, mesh),
        tuple(counts) if len(set(counts)) > 1 else (),
    )


def layer_table(plan: PipelinePlan, num_layers: int) -> np.ndarray:
    """int [S, R, C]: the layer that stage s runs at repeat r, slot c; -1 for a slot beyond an
    uneven stage's layers. Even: stage s runs layers [s·C, (s+1)·C) (R = 1), as it stores them;
    circular: chunk r·S + s at repeat r; uneven: stage s the next layers_per_stage[s]."""
    stages, repeats = plan.stages, plan.repeats
    if repeats > 1:
        chunks = np.arange(num_layers).reshape(repeats, stages, num_layers // (stages * repeats))
        return chunks.transpose(1, 0, 2)
    counts = plan.layers_per_stage or (num_layers // stages,) * stages
    table = np.full((stages, 1, max(counts)), -1)
    for stage, (start, count) in enumerate(zip(np.cumsum((0, *counts[:-1])), counts, strict=True)):
        table[stage, 0, :count] = np.arange(start, start + count)
    return table


def _local_number(device: jax.Device) -> int:
    """The device's number on its host, as a profiler trace names it."""
    return device.id if device.local_hardware_id is None else device.local_hardware_id


def measure_bubble(
    plan: PipelinePlan, communication: CommunicationReport, mesh: Mesh, trace: Path, steps: int
) -> list[str]:
    """The bubble of the traced steps (observe.bubble), as log lines: the hand-overs are the
    compiled step's collective-permutes over pp, one per schedule loop."""
    hand_overs: dict[str, bool] = {}  # the loop's, and its transpose's (gpipe, circular)
    for c in communication.collectives:
        transposed = "transpose(" in c.op_name
        on_pp = c.kind == "collective-permute" and c.mesh_axes == [AXIS]
        if on_pp and transposed not in hand_overs.values():
            hand_overs[c.name] = transposed
    pp_axis = mesh.axis_names.index(AXIS)
    stage_of = {
        _local_number(device): index[pp_axis]
        for index, device in np.ndenumerate(mesh.devices)
        if device.process_index == jax.process_index()
    }
    measured = measured_bubble(
        trace,
        module=communication.module,
        num_steps=steps,
        ticks=plan.ticks,
        hand_overs=hand_overs,
        stage_of=stage_of.get,
        idle_share=plan.idle_share,
    )
    if measured is None:
        return ["profiler: the trace does not hold every pipeline hand-over; no bubble measured"]
    return [
        f"profiler: pipeline bubble {measured['bubble']:.1%} of the ticks (formula "
        f"{plan.bubble:.1%}), {measured['bubble_of_step']:.1%} of the step; ticks of "
        f"{measured['tick_s'] * 1e3:.2f} ms (median), the pipeline's loops "
        f"{measured['pipeline_share']:.1%} of the step (mean of {measured['devices']} devices "
        f"over {measured['steps']} steps)"
    ]
