"""The profiler window (observe.profiler) as a hook: an annotation around every step inside
profile.start_step .. + profile.num_steps, the trace started before the window's first step and
written after its last, then the collectives' measured share and the pipeline's bubble logged."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshtrain.observe.communication import CommunicationReport
from meshtrain.observe.profiler import ProfilerWindow
from meshtrain.train.hooks.base import Cadence, StepInfo
from meshtrain.train.pipeline_plan import measure_bubble
from meshtrain.train.setup import Setup

log = logging.getLogger(__name__)


class Profiler:
    """Runs after every step (inside the window it ends the step's annotation; after its last
    step it writes the trace); `before_step` opens the trace and each step's annotation."""

    name = "profiler"
    part_of_step = True  # outside its window it does nothing; inside, it waits for the step
    cadence = Cadence(every=1)

    def __init__(
        self, setup: Setup, run_dir: Path, communication: CommunicationReport, *, is_main: bool
    ) -> None:
        cfg = setup.cfg
        self.setup, self.run_dir, self.communication = setup, run_dir, communication
        self.is_main = is_main
        self.window = ProfilerWindow(
            cfg.profile,
            run_dir,
            enabled=cfg.training.profile,
            last_step=cfg.training.steps,
            on_trace=self._report_measured,
        )

    def before_step(self, step: int, state: Any) -> None:
        self.window.before_step(step, state)

    def __call__(self, info: StepInfo) -> Mapping[str, float]:
        self.window.after_step(info.step, info.state)
        return {}

    def close(self) -> None:
        self.window.close()

    def _report_measured(self, trace: Path, num_steps: int) -> None:
        """The collectives' measured share of the traced steps, and the pipeline's measured
        bubble."""
        setup, communication = self.setup, self.communication
        lines = communication.measure(trace, num_steps)
        if setup.pipeline is not None:
            lines += measure_bubble(setup.pipeline, communication, setup.mesh, trace, num_steps)
        for line in lines:
            log.info(line)
        if setup.cfg.training.profile_communication and self.is_main:
            communication.write(self.run_dir / "communication.json")
