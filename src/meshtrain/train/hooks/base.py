"""What runs after a train step: hooks, each with its cadence, run in a fixed order.

A hook declares when it is due (`Cadence`: every N steps, the run's first step, its last, a step
after which a stop signal ends the run) and what it does with the step (`StepInfo`); it returns
the metrics it adds to the step's record (an empty dict for none). `HookRunner` runs the due
hooks in their order and writes the record once, after the last of them that adds metrics (a
checkpoint's save runs after the record: `after_record`). The time the hooks
take (an evaluation, a checkpoint's save) is kept out of the step time: the step clock restarts
after any hook that is not part of the step (`Hook.part_of_step`: the step metrics' own wait for
the devices is).

Anchors: Levanter's `TrainerHooks.add_hook(fn, every=N)` and `StepInfo`; torchtitan's
components, each owning its cadence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax


@dataclass(frozen=True)
class StepInfo:
    """One finished (dispatched) step, as the hooks see it."""

    step: int
    state: Any  # the train state after the step (train.state.TrainState)
    metrics: Mapping[str, jax.Array]  # the step's metrics, still on the devices
    first: bool  # the first step this run trained (after a resume: the one after the checkpoint)
    last: bool  # the run's last step (training.steps)
    stop: bool  # a stop signal ends the run after this step (every process agreed)


@dataclass(frozen=True)
class Cadence:
    """When a hook is due: any of its conditions holds."""

    every: int = 0  # every N steps (0: never by count)
    first: bool = False  # the first step this run trains
    last: bool = False  # the run's last step
    stop: bool = False  # a step after which a stop signal ends the run

    def due(self, info: StepInfo) -> bool:
        return (
            (self.every > 0 and info.step % self.every == 0)
            or (self.first and info.first)
            or (self.last and info.last)
            or (self.stop and info.stop)
        )


@dataclass(frozen=True)
class AnyOf:
    """Due when any of several cadences is (the step metrics are due wherever a record is)."""

    cadences: tuple[Cadence | AnyOf, ...]

    def due(self, info: StepInfo) -> bool:
        return any(cadence.due(info) for cadence in self.cadences)


class Hook(Protocol):
    """A piece of work after the step; see the module docstring. A hook may also define
    `before_step(step, state)`, called before each step is dispatched (the profiler opens its
    trace there), `close()`, called when the loop ends, also on an error, and `after_record =
    True` to run after the step's record is written (HookRunner)."""

    name: str
    cadence: Cadence | AnyOf
    part_of_step: bool  # its time is the step's (waiting for the devices), not kept out

    def __call__(self, info: StepInfo) -> Mapping[str, float]: ...


class HookRunner:
    """Runs the due hooks of each step in order and writes their record once.

    write(step, record): where a record goes (observe.metrics.MetricsWriter.write);
    restart_clock(step): what keeps the hooks' time out of the step time. Hooks marked
    `after_record` (the checkpoint save) run after the record is written, so that a process
    killed once a checkpoint is committed has logged that step. A hook that raises leaves the
    record of what ran before it written; if it was not part of the step (an evaluation), the
    step's state is sound and the after-record hooks still run (the checkpoint due is saved)
    before the error goes on; a failure inside the step (the non-finite guard) saves nothing.
    """

    def __init__(
        self,
        hooks: Iterable[Hook],
        *,
        write: Callable[[int, Mapping[str, float]], None],
        restart_clock: Callable[[int], None],
    ) -> None:
        self.hooks: Sequence[Hook] = tuple(hooks)
        self._before = [h for h in self.hooks if not getattr(h, "after_record", False)]
        self._after = [h for h in self.hooks if getattr(h, "after_record", False)]
        self._write, self._restart_clock = write, restart_clock
        self.ran: list[str] = []  # the hooks that ran after the last step, in order
        self.seconds: dict[str, float] = {}  # each hook's time over the run
        self._outside_step = False  # a hook that is not part of the step ran after the last step

    def before_step(self, step: int, state: Any) -> None:
        for hook in self.hooks:
            if (before := getattr(hook, "before_step", None)) is not None:
                before(step, state)

    def run(self, info: StepInfo) -> dict[str, float]:
        """The due hooks of `info.step`, in order; returns the record written ({} for none)."""
        record: dict[str, float] = {}
        self.ran, self._outside_step = [], False
        running: Hook | None = None  # the hook that raised, if one did
        try:
            for hook in self._before:
                if hook.cadence.due(info):
                    running = hook
                    record.update(self._timed(hook, info))
            running = None
        finally:
            try:
                if record:
                    self._write(info.step, record)
                if running is None or not running.part_of_step:
                    for hook in self._after:
                        if hook.cadence.due(info):
                            self._timed(hook, info)
            finally:
                if self._outside_step:
                    self._restart_clock(info.step)
        return record

    def _timed(self, hook: Hook, info: StepInfo) -> Mapping[str, float]:
        start = time.perf_counter()
        try:
            return hook(info)
        finally:
            self.seconds[hook.name] = self.seconds.get(hook.name, 0.0) + (
                time.perf_counter() - start
            )
            self.ran.append(hook.name)
            self._outside_step = self._outside_step or not hook.part_of_step

    def close(self) -> None:
        for hook in self.hooks:
            if (close := getattr(hook, "close", None)) is not None:
                close()

    def __enter__(self) -> HookRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
