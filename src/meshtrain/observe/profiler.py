"""The profiler window: a JAX profiler trace of steps [profile.start_step, + profile.num_steps)
written to <run_dir>/profile/, which TensorBoard's profile plugin and xprof open.

The loop calls `before_step` and `after_step` around every step. The trace starts and stops on
step boundaries with the device synchronized (the state is ready), so it holds whole steps and
nothing else; each step is a `StepTraceAnnotation`. Process 0 traces, or every process with
profile.all_ranks=true (process i > 0 into profile/process_<i>/).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from meshtrain.config import ProfileConfig
from meshtrain.observe.trace import find_trace

log = logging.getLogger(__name__)


def profile_dir(run_dir: Path, process_index: int) -> Path:
    return (
        run_dir / "profile"
        if process_index == 0
        else run_dir / "profile" / f"process_{process_index}"
    )


class ProfilerWindow:
    """Starts a trace before step `start_step` and stops it after the window's last step."""

    def __init__(
        self,
        cfg: ProfileConfig,
        run_dir: Path,
        *,
        enabled: bool,
        last_step: int,
        on_trace: Callable[[Path, int], None] | None = None,
    ) -> None:
        process = jax.process_index()
        self.active = enabled and (process == 0 or cfg.all_ranks)
        self.first = cfg.start_step
        # A window that runs past the end of training stops at the last step.
        self.last = min(cfg.start_step + cfg.num_steps - 1, last_step)
        self.directory = profile_dir(run_dir, process)
        self.trace: Path | None = None
        self._on_trace = on_trace
        self._annotation: jax.profiler.StepTraceAnnotation | None = None
        self._tracing = False

    def before_step(self, step: int, state: Any) -> None:
        if not self.active:
            return
        if step == self.first:
            jax.block_until_ready(state)  # no work of earlier steps in flight
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self._tracing = True
            log.info(
                "profiler: tracing steps %d to %d into %s", self.first, self.last, self.directory
            )
        if self._tracing:
            self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
            self._annotation.__enter__()

    def after_step(self, step: int, state: Any) -> None:
        if not self._tracing:
            return
        self._end_annotation()
        if step == self.last:
            jax.block_until_ready(state)  # the window holds the whole of its last step
            self._stop()
            self.trace = find_trace(self.directory)
            log.info("profiler: trace written to %s", self.trace)
            if self._on_trace is not None and self.trace is not None:
                self._on_trace(self.trace, self.last - self.first + 1)

    def close(self) -> None:
        """Stops a trace left open by a run that ended inside the window (e.g. an exception)."""
        if self._tracing:
            self._end_annotation()
            self._stop()

    def __enter__(self) -> ProfilerWindow:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _end_annotation(self) -> None:
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None

    def _stop(self) -> None:
        jax.profiler.stop_trace()
        self._tracing = False
