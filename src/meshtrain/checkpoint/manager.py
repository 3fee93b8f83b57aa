"""This run's checkpoints: what it starts from, when it saves, and that nothing good is lost.

The training loop uses three calls and a `with`:

    checkpoints = RunCheckpoints.open(cfg, run_dir, plan)        # start-up checks, nothing compiled
    state, start_step = checkpoints.restore_or_init(abstract, init, batches)
    checkpoints.maybe_save(step, state, batches, force=is_last)  # every checkpoint.every_steps

Leaving the `with` block waits until the last asynchronous write has committed.

Where a run starts from (checkpoint.resume, checkpoint.load_params):
  - auto: the newest readable checkpoint in checkpoint.dir; if there is none, load_params or a
    fresh init. A damaged newest checkpoint is reported, moved aside to `<step>.corrupted`
    (never deleted) and the previous one is used.
  - never: a fresh init (or load_params); refuses a checkpoint.dir that already holds checkpoints
    unless checkpoint.overwrite=true, which deletes them.
  - a path: that checkpoint, a directory of them, or a run directory.

Saving uses orbax's CheckpointManager: each checkpoint is written under a temporary name and
renamed when complete (a killed write is never listed), and a checkpoint beyond checkpoint.keep is
deleted only after the newer one has committed. All processes call every method here; orbax
writes each array's shards from the processes that hold them.

Test hook (tests only; never set it otherwise): with MESHTRAIN_TEST_KILL_AFTER_SAVE=<step> the
process SIGKILLs itself as soon as the checkpoint of <step> has committed, and with
MESHTRAIN_TEST_KILL_AFTER_SAVE=<step>:writing right after that save has started, while it is
still being written. This is how tests crash a run at an exact point.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from meshtrain.checkpoint.layout import (
    CorruptCheckpoint,
    committed_steps,
    find_checkpoints,
    first_param_mismatch,
    first_state_mismatch,
    read_meta,
    read_params,
    read_state,
    save_args,
    saved_params,
)
from meshtrain.config import CheckpointConfig, Config
from meshtrain.data import BatchIterator
from meshtrain.errors import ConfigError
from meshtrain.train.guard import raise_if_nonfinite
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.state import ModelPlan, TrainState, train_state_shapes

log = logging.getLogger(__name__)

RESUME_MODES = ("auto", "never")
TEST_KILL_ENV = "MESHTRAIN_TEST_KILL_AFTER_SAVE"


@dataclasses.dataclass(frozen=True)
class _Source:
    """What the run starts from: checkpoints to try newest first, or nothing (a fresh init)."""

    kind: str  # "resume" (the whole train state), "params" (weights only) or "fresh"
    key: str  # the config key that named the source, for messages
    candidates: tuple[Path, ...] = ()
    start_step: int = 0  # the step of the newest candidate with a readable description


class RunCheckpoints:
    """The checkpoints of one run; use `open`, then as a context manager."""

    def __init__(self, cfg: Config, directory: Path, source: _Source) -> None:
        self.cfg = cfg
        self.directory = directory
        self.source = source
        self.last_saved: Path | None = None
        self._manager: ocp.CheckpointManager | None = None

    @classmethod
    def open(cls, cfg: Config, run_dir: Path, plan: ModelPlan) -> RunCheckpoints:
        """Checks the checkpoint settings against the disk and the model; raises ConfigError
        (nothing compiled, nothing overwritten) for a value that cannot work."""
        ckpt = cfg.checkpoint
        _check_values(ckpt)
        # orbax logs each phase of every save at INFO through absl; its warnings still show.
        logging.getLogger("absl").setLevel(logging.WARNING)
        directory = (Path(ckpt.dir) if ckpt.dir else Path(run_dir) / "checkpoints").resolve()
        source = _choose_source(ckpt, directory)
        if source.candidates:
            source = _check_model(source, plan, cfg)
        if source.start_step > cfg.training.steps:
            raise ConfigError(
                f"training.steps={cfg.training.steps} is below step {source.start_step} of the "
                f"checkpoint to resume ({source.candidates[0].parent}); raise training.steps to "
                "train on from there"
            )
        later = [
            step
            for step in committed_steps(directory)
            if step > source.start_step and directory / str(step) not in source.candidates
        ]
        if later and not ckpt.overwrite:
            raise ConfigError(_later_steps_message(ckpt, directory, later, source.start_step))
        _check_writable(directory)
        return cls(cfg, directory, source)

    def restore_or_init(
        self,
        abstract: TrainState,
        init: Callable[[Any], TrainState],
        batches: BatchIterator,
    ) -> tuple[TrainState, int]:
        """The train state to start from and its step; `batches` is moved to that step.

        `abstract` holds the shapes and the shardings of this run's mesh, so every array is read
        straight into its shards whatever mesh wrote it. `init(params_or_None)` creates a fresh
        state, around given parameters for fine-tuning.
        """
        source, start = self.source, 0
        if source.kind == "resume":
            (state, meta), path = self._read_newest(lambda p: read_state(p, abstract))
            start = int(meta["step"])
            batches.set_state(meta["data"])
            self.last_saved = path
            log.info("resuming from %s at step %d", path, start)
            if meta.get("global_batch") != batches.global_batch:
                log.warning(
                    "the checkpoint was trained with a global batch of %s sequences, this run "
                    "uses %d: the data order from here on differs from the original run's",
                    meta.get("global_batch"),
                    batches.global_batch,
                )
        elif source.kind == "params":
            (params, meta), path = self._read_newest(lambda p: read_params(p, abstract.params))
            state = init(params)
            log.info(
                "parameters from %s (step %s); the optimizer, step and data position start fresh",
                path,
                meta.get("step"),
            )
        else:
            state = init(None)
        self._remove_later_steps(start)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.cfg.checkpoint.keep,
                enable_async_checkpointing=self.cfg.checkpoint.async_save,
                cleanup_tmp_directories=True,  # half-written saves of a killed run
                create=True,
            ),
        )
        return state, start

    def maybe_save(
        self, step: int, state: TrainState, batches: BatchIterator, *, force: bool = False
    ) -> bool:
        """Saves the state after `step` every checkpoint.every_steps steps, or when forced.

        Refuses (NonFiniteError) to save a state that has met a NaN or Inf with
        training.nonfinite=stop. Returns whether a save started.
        """
        every = self.cfg.checkpoint.every_steps
        due = force or (every > 0 and step % every == 0)
        if not due or self._manager is None or self._manager.latest_step() == step:
            return False
        last = str(self.last_saved) if self.last_saved else None
        raise_if_nonfinite(state.nonfinite, self.cfg.training.nonfinite, last_saved=last)
        meta = {
            "step": step,
            "data": batches.get_state(),
            "global_batch": batches.global_batch,
            "config": dataclasses.asdict(self.cfg),
        }
        self._manager.save(step, args=save_args(state, meta), force=True)
        self.last_saved = self.directory / str(step)
        log.info("checkpoint of step %d → %s", step, self.last_saved)
        _maybe_kill_for_test(self._manager, step)
        return True

    def close(self) -> None:
        """Waits for the last asynchronous write to commit (raising its error, if any)."""
        if self._manager is not None:
            manager, self._manager = self._manager, None
            manager.wait_until_finished()
            manager.close()

    def __enter__(self) -> RunCheckpoints:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _read_newest(self, read: Callable[[Path], Any]) -> tuple[Any, Path]:
        """read(path) of the newest candidate that reads back intact. Damaged ones newer than it
        in this run's own directory are then moved aside, so new saves can reuse their steps;
        if none is intact, nothing is moved."""
        damaged: list[tuple[Path, str]] = []
        for path in self.source.candidates:
            try:
                result = read(path)
            except CorruptCheckpoint as err:
                log.warning("%s; trying the previous checkpoint", err)
                damaged.append((path, str(err)))
                continue
            for bad, _ in damaged:
                if bad.parent == self.directory:
                    self._set_aside(bad)
            return result, path
        count = len(damaged)
        raise ConfigError(
            f"{self.source.key}: no readable checkpoint ({count} tried; the newest: "
            f"{damaged[0][1]}); point {self.source.key} at a good copy, or start fresh with "
            "checkpoint.resume=never checkpoint.overwrite=true"
        )

    def _set_aside(self, path: Path) -> None:
        target = path.with_name(f"{path.name}.corrupted")
        suffix = 1
        while target.exists():
            suffix += 1
            target = path.with_name(f"{path.name}.corrupted-{suffix}")
        if jax.process_index() == 0:
            path.rename(target)
            log.warning("moved the damaged checkpoint %s aside to %s", path, target)
        _sync_processes("meshtrain_checkpoint_set_aside")

    def _remove_later_steps(self, start: int) -> None:
        """Deletes this directory's checkpoints after the start step (checkpoint.overwrite=true):
        the new run saves those step numbers again."""
        later = [step for step in committed_steps(self.directory) if step > start]
        if not later:
            return
        if not self.cfg.checkpoint.overwrite:
            raise ConfigError(
                _later_steps_message(self.cfg.checkpoint, self.directory, later, start)
            )
        if jax.process_index() == 0:
            for step in later:
                shutil.rmtree(self.directory / str(step))
            log.warning(
                "deleted checkpoints %s in %s (checkpoint.overwrite=true)",
                ", ".join(map(str, later)),
                self.directory,
            )
        _sync_processes("meshtrain_checkpoint_remove_later")


def _check_values(ckpt: CheckpointConfig) -> None:
    if ckpt.every_steps < 0:
        raise ConfigError(
            f"checkpoint.every_steps={ckpt.every_steps} must be >= 0 (0: save only at the end "
            "and on SIGTERM/SIGINT)"
        )
    if ckpt.keep < 1:
        raise ConfigError(
            f"checkpoint.keep={ckpt.keep} must be >= 1; keep 2 or more to have a fallback "
            "if the newest checkpoint is damaged"
        )
    if not ckpt.resume:
        raise ConfigError("checkpoint.resume is empty; use auto, never or a checkpoint path")
    if ckpt.resume not in RESUME_MODES and ckpt.load_params:
        raise ConfigError(
            f"checkpoint.resume={ckpt.resume} and checkpoint.load_params={ckpt.load_params} are "
            "both set; resume continues a run with its own parameters, so drop one of them"
        )


def _checkpoints_at(key: str, value: str) -> tuple[Path, ...]:
    path = Path(value).resolve()
    if not path.exists():
        raise ConfigError(
            f"{key}={value} does not exist; give a checkpoint directory such as "
            "outputs/<name>/<date>/<time>/checkpoints/<step>, its checkpoints/ directory or its run directory"
        )
    found = find_checkpoints(path)
    if not found:
        raise ConfigError(
            f"{key}={value} holds no complete checkpoint (a directory with params/ and meta/, "
            "a directory of step directories, or a run directory with checkpoints/)"
        )
    return tuple(found)


def _choose_source(ckpt: CheckpointConfig, directory: Path) -> _Source:
    if ckpt.resume not in RESUME_MODES:
        return _Source(
            "resume", "checkpoint.resume", _checkpoints_at("checkpoint.resume", ckpt.resume)
        )
    if ckpt.resume == "auto":
        own = tuple(directory / str(step) for step in reversed(committed_steps(directory)))
        if own:
            return _Source("resume", "checkpoint.resume", own)
    if ckpt.load_params:
        return _Source(
            "params",
            "checkpoint.load_params",
            _checkpoints_at("checkpoint.load_params", ckpt.load_params),
        )
    return _Source("fresh", "checkpoint.resume")


def _check_model(source: _Source, plan: ModelPlan, cfg: Config) -> _Source:
    """Compares the newest candidate that has a readable description with the model and, when
    resuming, with the optimizer's state; damaged ones are left for restore_or_init to report
    and skip."""
    for path in source.candidates:
        try:
            meta, saved = read_meta(path), saved_params(path)
        except CorruptCheckpoint:
            continue
        mismatch = first_param_mismatch(saved, plan.abstract_params)
        if mismatch:
            raise ConfigError(
                f"{source.key}: {path} was written for another model: {mismatch}; use the model "
                "config it was trained with (saved in its meta/), or start fresh with "
                "checkpoint.resume=never"
            )
        if source.kind != "resume":
            return source
        expected = train_state_shapes(plan, build_optimizer(cfg.training)).replace(params=None)
        mismatch = first_state_mismatch(meta, expected)
        if mismatch:
            raise ConfigError(
                f"{source.key}: {path} was written with other optimizer settings: {mismatch}; "
                "resume with the training.* settings it was trained with (saved in its meta/; "
                "training.grad_clip=0 or > 0 changes the state), or fine-tune from its weights "
                f"in a new run with checkpoint.load_params={path}"
            )
        return dataclasses.replace(source, start_step=int(meta.get("step", 0)))
    return source


def _later_steps_message(
    ckpt: CheckpointConfig, directory: Path, later: list[int], start: int
) -> str:
    steps = ", ".join(map(str, later))
    if ckpt.resume == "never":
        return (
            f"checkpoint.resume=never, but checkpoint.dir={directory} already holds checkpoints "
            f"(steps {steps}); continue them with checkpoint.resume=auto, use another checkpoint.dir "
            "or hydra.run.dir, or set checkpoint.overwrite=true to delete them"
        )
    return (
        f"checkpoint.dir={directory} already holds checkpoints after the start step {start} "
        f"(steps {steps}); use another checkpoint.dir or hydra.run.dir, or set "
        "checkpoint.overwrite=true to delete them"
    )


def _check_writable(directory: Path) -> None:
    """Creates the directory and a probe file in it, so a bad path fails before any compile."""
    probe = directory / f".write-probe-{jax.process_index()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"checkpoint.dir={directory} is not writable ({err.strerror or err}); "
            "set checkpoint.dir=<a writable directory>"
        ) from None


def _sync_processes(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _maybe_kill_for_test(manager: ocp.CheckpointManager, step: int) -> None:
    """The test hook described in the module docstring."""
    value = os.environ.get(TEST_KILL_ENV)
    if not value:
        return
    target, _, phase = value.partition(":")
    if int(target) != step:
        return
    if phase != "writing":
        manager.wait_until_finished()
    os.kill(os.getpid(), signal.SIGKILL)
