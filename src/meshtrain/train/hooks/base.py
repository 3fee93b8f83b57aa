"""What runs after a train step: hooks, each with its cadence, run in a fixed order.

A hook declares when it is due (`Cadence`: every N steps, the run's first step, its last, a step
after which a stop signal ends the run) and what it does with the step (`StepInfo`); it returns
the metrics it adds to the step's record (an empty dict for none). `HookRunner` runs the due
hooks in their order and writes the record once, after the last of them. The time the hooks
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
    trace there), and `close()`, called when the loop ends, also on an error."""

    name: str
    cadence: Cadence | AnyOf
    part_of_step: bool  # its time is the step's (waiting for the devices), not kept out

    def __call__(self, info: StepInfo) -> Mapping[str, float]: ...


class HookRunner:
    """Runs the due hooks of each step in order and writes their record once.

    write(step, record): where a record goes (observe.metrics.MetricsWriter.write);
    restart_clock(step): what keeps the hooks' time out of the step time. A hook that raises
    leaves the record of what ran before it written, then the error goes on.
    """

    def __init__(
        self,
        hooks: Iterable[Hook],
        *,
        write: Callable[[int, Mapping[str, float]], None],
        restart_clock: Callable[[int], None],
    ) -> None:
        self.hooks: Sequence[Hook] = tuple(hooks)
        self._write, self._restart_clock = write, restart_clock
        self.ran: list[str] = []  # the hooks that ran after the last step, in order
        self.seconds: dict[str, float] = {}  # each hook's time over the run

    def before_step(self, step: int, state: Any) -> None:
        for hook in self.hooks:
            if (before := getattr(hook, "before_step", None)) is not None:
                before(step, state)

    def run(self, info: StepInfo) -> dict[str, float]:
        """The due hooks of `info.step`, in order; returns the record written ({} for none)."""
        record: dict[str, float] = {}
        self.ran = []
        outside_step = False
        try:
            for hook in self.hooks:
                if not hook.cadence.due(info):
                    continue
                start = time.perf_counter()
                record.update(hook(info))
                self.seconds[hook.name] = self.seconds.get(hook.name, 0.0) + (
                    time.perf_counter() - start
                )
                self.ran.append(hook.name)
                outside_step = outside_step or not hook.part_of_step
        finally:
            if record:
                self._write(info.step, record)
            if outside_step:
                self._restart_clock(info.step)
        return record

    def close(self) -> None:
        for hook in self.hooks:
            if (close := getattr(hook, "close", None)) is not None:
                close()

    def __enter__(self) -> HookRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
