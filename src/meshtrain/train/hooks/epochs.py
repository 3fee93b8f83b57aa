"""The log line that marks where a pass over the training sequences ends and the next begins:
`data: epoch 2 begins at step 34 (264 training sequences per epoch)`. A run over a small
fine-tuning set cycles through it many times; this says when (a mixture draws its sources by
weight and has no epochs: no line)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from meshtrain.train.hooks.base import Cadence, StepInfo

log = logging.getLogger(__name__)


class EpochLog:
    """Logs the epochs that begin within a step: those whose first sequence the step takes."""

    name = "epochs"
    part_of_step = True  # a division per step
    cadence = Cadence(every=1)

    def __init__(self, sequences: int, global_batch: int, position: Callable[[int], int]):
        """sequences: one epoch's; position(k): the stream position of iterator step k's first
        sequence (DeviceBatches.position), so that loop step s takes position(s - 1) on."""
        self.sequences, self.global_batch, self.position = sequences, global_batch, position

    def __call__(self, info: StepInfo) -> Mapping[str, float]:
        first = self.position(info.step - 1)  # the step's sequences: first .. first + batch - 1
        begun = range(
            max(1, -(-first // self.sequences)),
            (first + self.global_batch - 1) // self.sequences + 1,
        )
        if begun:
            epochs = (
                f"epoch {begun[0] + 1} begins"
                if len(begun) == 1
                else f"epochs {begun[0] + 1}-{begun[-1] + 1} begin"
            )
            log.info(
                "data: %s at step %d (%d training sequences per epoch)",
                epochs,
                info.step,
                self.sequences,
            )
        return {}
