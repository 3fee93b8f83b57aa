"""The validation metrics as hooks, every training.eval_every steps and at the last step: the
objective's loss and metrics over held-out batches, or what a measure of the state reports."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from meshtrain.train.hooks.base import Cadence, StepInfo


class ValidationLoss:
    """val_loss (the objective's loss over the fixed held-out batches, train.evaluation), the
    perplexity where the loss is a next-token one, and the objective's other metrics, each as
    val_<name>."""

    name = "validation loss"
    part_of_step = False

    def __init__(
        self, evaluate: Callable[[object], dict[str, float]], *, every: int, perplexity: bool
    ) -> None:
        self.evaluate, self.perplexity = evaluate, perplexity
        self.cadence = Cadence(every=every, last=True)

    def __call__(self, info: StepInfo) -> Mapping[str, float]:
        metrics = self.evaluate(info.state)
        loss = metrics.pop("loss")
        values = {"val_loss": loss}
        if self.perplexity:
            values["val_perplexity"] = math.exp(min(loss, 80.0))
        return {**values, **{f"val_{name}": value for name, value in metrics.items()}}


class ValidationMetrics:
    """Metrics of the state measured on held-out data by `measure` (a policy-gradient run's
    validation rollouts: meshtrain.rl.sampling.ValidationRollouts), each as val_<name>."""

    name = "validation rollouts"
    part_of_step = False

    def __init__(self, measure: Callable[[object], Mapping[str, float]], *, every: int) -> None:
        self.measure = measure
        self.cadence = Cadence(every=every, last=True)

    def __call__(self, info: StepInfo) -> Mapping[str, float]:
        return {f"val_{name}": value for name, value in self.measure(info.state).items()}
