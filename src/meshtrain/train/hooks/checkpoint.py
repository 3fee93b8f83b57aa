"""Checkpoints as hooks: the guard that stops on a non-finite step before anything saves it,
and the save of the state when due (checkpoint.every_steps, the last step, a stop signal)."""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain.checkpoint import RunCheckpoints
from meshtrain.config.schema import CheckpointConfig, NonfiniteMode
from meshtrain.train.batch import BatchSource
from meshtrain.train.guard import raise_if_nonfinite
from meshtrain.train.hooks.base import AnyOf, Cadence, StepInfo
from meshtrain.train.state import split_state


def save_cadence(cfg: CheckpointConfig) -> Cadence:
    """When the state is saved: every checkpoint.every_steps steps, the last step and a step
    after which a signal stops the run."""
    return Cadence(every=cfg.every_steps, last=True, stop=True)


class NonfiniteGuard:
    """training.nonfinite=stop: raises (train.guard) at the first record or save after a step
    that met a NaN or Inf, naming the last checkpoint; that state is never saved."""

    name = "non-finite guard"
    part_of_step = True  # a read of one flag the step already wrote

    def __init__(
        self, cadence: Cadence | AnyOf, *, mode: NonfiniteMode, checkpoints: RunCheckpoints
    ) -> None:
        self.cadence, self.mode, self.checkpoints = cadence, mode, checkpoints

    def __call__(self, info: StepInfo) -> Mapping[str, float]:
        raise_if_nonfinite(info.state.nonfinite, self.mode, last_saved=self.checkpoints.last_saved)
        return {}


class SaveCheckpoint:
    """Saves the state after a due step (not twice: a step saved already is skipped). It runs
    after the step's record is written (a process killed once the checkpoint is committed has
    logged the step), and also after a failing evaluation of that step (HookRunner), so that
    costs no training state."""

    name = "checkpoint"
    part_of_step = False  # the save waits for the step; its own time is not step time
    after_record = True

    def __init__(
        self, cfg: CheckpointConfig, *, checkpoints: RunCheckpoints, batches: BatchSource
    ) -> None:
        self.cadence = save_cadence(cfg)
        self.checkpoints, self.batches = checkpoints, batches
        self.saved_step: int | None = None  # the step of the last save this run started

    def __call__(self, info: StepInfo) -> Mapping[str, float]:
        if self.checkpoints.is_due(info.step, force=True):  # not saved at this step already
            params, rest = split_state(info.state)
            self.checkpoints.save(info.step, params, rest, self.batches)
            self.saved_step = info.step
        return {}
