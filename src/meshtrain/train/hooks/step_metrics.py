"""The step's own record: its metrics (loss, learning rate, gradient norm; one host transfer),
its time, tokens per second, MFU, the data wait, and each mixture source's share of the data."""

from __future__ import annotations

import time
from collections.abc import Mapping

import jax

from meshtrain.observe.throughput import ThroughputMeter
from meshtrain.train.batch import BatchSource
from meshtrain.train.hooks.base import AnyOf, Cadence, StepInfo

# The step's metrics in the order they are logged (nonfinite_skips only with nonfinite=skip);
# the objective's own follow them (Objective.metric_names).
STEP_METRICS = ("loss", "learning_rate", "grad_norm", "nonfinite_skips")


class StepClock:
    """Wall time of the steps since the last measurement: fetching a step's metrics waits for
    it, so the interval up to a fetch is real device time. The step was compiled before the
    loop; the first step includes only warm-up effects. `restart` keeps what ran since (a hook's
    time, opening the trackers) out of the next measurement."""

    def __init__(self, step: int) -> None:
        self.restart(step)

    def restart(self, step: int) -> None:
        self.start, self.step = time.perf_counter(), step

    def per_step(self, step: int) -> float:
        now = time.perf_counter()
        seconds = (now - self.start) / (step - self.step)
        self.start, self.step = now, step
        return seconds


class StepMetrics:
    """The hook that reads the step's metrics from the devices, wherever a record is due."""

    name = "step metrics"
    part_of_step = True  # the fetch waits for the step itself

    def __init__(
        self,
        cadence: Cadence | AnyOf,
        *,
        clock: StepClock,
        meter: ThroughputMeter,
        tokens_per_step: int,
        batches: BatchSource,
        objective_metrics: tuple[str, ...] = (),
    ) -> None:
        self.cadence, self.clock, self.meter = cadence, clock, meter
        self.tokens_per_step, self.batches = tokens_per_step, batches
        self.names = (*STEP_METRICS, *objective_metrics)

    def __call__(self, info: StepInfo) -> Mapping[str, float]:
        fetched = jax.device_get(dict(info.metrics))
        values = {k: float(fetched[k]) for k in self.names if k in fetched}
        values["step_time_s"] = self.clock.per_step(info.step)
        values["tokens_per_sec"] = self.tokens_per_step / values["step_time_s"]
        values.update(self.meter.metrics(values["step_time_s"]))
        values.update(self.batches.logged(info.step))  # mixture shares, rollout metrics
        return values
