"""This run's checkpoints: what it resumes from, when it saves, and that nothing good is lost.

A checkpoint holds a state as two pytrees of arrays, the parameters and the rest, with abstract
targets (ShapeDtypeStructs with shardings) given at `open`; this module knows nothing of what
they mean. The training loop uses four calls and a `with`:

    checkpoints = RunCheckpoints.open(cfg.checkpoint, run_dir, abstract_params, abstract_rest, ...)
    params, rest, start_step = checkpoints.restore_or_init(init, data)
    if checkpoints.is_due(step, force=is_last):                  # every checkpoint.every_steps
        checkpoints.save(step, params, rest, data)

Leaving the `with` block waits until the last asynchronous write has committed.

Where a run resumes from (checkpoint.resume):
  - auto: the newest readable checkpoint in checkpoint.dir; if there is none, `init()` (a fresh
    state, or one around checkpoint.load_params: meshtrain.train.initial_weights). A damaged
    newest checkpoint is reported, moved aside to `<step>.corrupted` (never deleted) and the
    previous one is used.
  - never: `init()`; refuses a checkpoint.dir that already holds checkpoints unless
    checkpoint.overwrite=true, which deletes them.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

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
    read_state,
    save_args,
    saved_params,
)
from meshtrain.config.schema import CheckpointConfig, ResumeMode, choices
from meshtrain.errors import ConfigError

log = logging.getLogger(__name__)


TEST_KILL_ENV = "MESHTRAIN_TEST_KILL_AFTER_SAVE"


class DataPosition(Protocol):
    """Where the input pipeline stands: saved with each checkpoint, set again on resume."""

    global_batch: int

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass(frozen=True)
class _Source:
    """What the run starts from: checkpoints to try newest first, or nothing (a fresh init)."""

    kind: str  # "resume" (the whole state) or "fresh"
    key: str  # the config key that named the source, for messages
    candidates: tuple[Path, ...] = ()
    start_step: int = 0  # the step of the newest candidate with a readable description


class RunCheckpoints:
    """The checkpoints of one run; use `open`, then as a context manager."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        directory: Path,
        source: _Source,
        abstract: tuple[Any, Any],
        run_config: dict[str, Any],
    ) -> None:
        self.cfg = cfg
        self.directory = directory
        self.source = source
        self.abstract_params, self.abstract_rest = abstract
        self.run_config = run_config
        self.last_saved: Path | None = None
        self._manager: ocp.CheckpointManager | None = None

    @classmethod
    def open(
        cls,
        cfg: CheckpointConfig,
        run_dir: Path,
        abstract_params: Any,
        abstract_rest: Any,
        *,
        steps: int,
        run_config: dict[str, Any],
    ) -> RunCheckpoints:
        """Checks the checkpoint settings against the disk and the state's structure; raises
        ConfigError (nothing compiled, nothing overwritten) for a value that cannot work.

        The abstract targets carry the shapes and shardings of this run's mesh, so every array
        is read straight into its shards whatever mesh wrote it. `steps` is the run's last step
        (training.steps); `run_config` is saved in each checkpoint's meta/.
        """
        # orbax logs each phase of every save at INFO through absl; its warnings still show.
        logging.getLogger("absl").setLevel(logging.WARNING)
        directory = (Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints").resolve()
        source = _choose_source(cfg, directory)
        if source.candidates:
            source = _check_state(source, abstract_params, abstract_rest)
        if source.start_step > steps:
            raise ConfigError(
                f"training.steps={steps} is below step {source.start_step} of the "
                f"checkpoint to resume ({source.candidates[0].parent}); raise training.steps to "
                "train on from there"
            )
        later = [
            step
            for step in committed_steps(directory)
            if step > source.start_step and directory / str(step) not in source.candidates
        ]
        if later and not cfg.overwrite:
            raise ConfigError(_later_steps_message(cfg, directory, later, source.start_step))
        _check_writable(directory)
        return cls(cfg, directory, source, (abstract_params, abstract_rest), run_config)

    @property
    def resuming(self) -> bool:
        """Whether restore_or_init will read a checkpoint of this run (else it calls init)."""
        return self.source.kind == "resume"

    def restore_or_init(
        self, init: Callable[[], tuple[Any, Any]], data: DataPosition
    ) -> tuple[Any, Any, int]:
        """(parameters, rest of the state, step) to start from; `data` is moved to that step.
        Without a checkpoint to resume, `init()` gives the fresh (parameters, rest)."""
        start = 0
        if self.resuming:
            (params, rest, meta), path = read_newest(
                self.source.candidates,
                lambda p: read_state(p, self.abstract_params, self.abstract_rest),
                key=self.source.key,
                own_directory=self.directory,
            )
            start = int(meta["step"])
            data.set_state(meta["data"])
            self.last_saved = path
            log.info("resuming from %s at step %d", path, start)
            if meta.get("global_batch") != data.global_batch:
                log.warning(
                    "the checkpoint was trained with a global batch of %s sequences, this run "
                    "uses %d: the data order from here on differs from the original run's",
                    meta.get("global_batch"),
                    data.global_batch,
                )
        else:
            params, rest = init()
        self._remove_later_steps(start)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.cfg.keep,
                enable_async_checkpointing=self.cfg.async_save,
                cleanup_tmp_directories=True,  # half-written saves of a killed run
                create=True,
            ),
        )
        return params, rest, start

    def is_due(self, step: int, *, force: bool = False) -> bool:
        """Whether the state after `step` is to be saved: every checkpoint.every_steps steps, or
        when forced, unless that step is saved already."""
        every = self.cfg.every_steps
        due = force or (every > 0 and step % every == 0)
        return due and self._manager is not None and self._manager.latest_step() != step

    def save(self, step: int, params: Any, rest: Any, data: DataPosition) -> None:
        """Starts writing the state after `step` (in the background with async_save)."""
        assert self._manager is not None, "restore_or_init comes first"
        meta = {
            "step": step,
            "data": data.get_state(),
            "global_batch": data.global_batch,
            "config": self.run_config,
        }
        self._manager.save(step, args=save_args(params, rest, meta), force=True)
        self.last_saved = self.directory / str(step)
        log.info("checkpoint of step %d → %s", step, self.last_saved)
        _maybe_kill_for_test(self._manager, step)

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

    def _remove_later_steps(self, start: int) -> None:
        """Deletes this directory's checkpoints after the start step (checkpoint.overwrite=true):
        the new run saves those step numbers again."""
        later = [step for step in committed_steps(self.directory) if step > start]
        if not later:
            return
        if not self.cfg.overwrite:
            raise ConfigError(_later_steps_message(self.cfg, self.directory, later, start))
        if jax.process_index() == 0:
            for step in later:
                shutil.rmtree(self.directory / str(step))
            log.warning(
                "deleted checkpoints %s in %s (checkpoint.overwrite=true)",
                ", ".join(map(str, later)),
                self.directory,
            )
        _sync_processes("meshtrain_checkpoint_remove_later")


def read_newest(
    candidates: Sequence[Path], read: Callable[[Path], Any], *, key: str, own_directory: Path
) -> tuple[Any, Path]:
    """read(path) of the newest candidate that reads back intact. Damaged ones newer than it in
    `own_directory` (this run's) are then moved aside, so new saves can reuse their steps; if
    none is intact, nothing is moved and the ConfigError names `key`, the config key that
    named the candidates."""
    damaged: list[tuple[Path, str]] = []
    for path in candidates:
        try:
            result = read(path)
        except CorruptCheckpoint as err:
            log.warning("%s; trying the previous checkpoint", err)
            damaged.append((path, str(err)))
            continue
        for bad, _ in damaged:
            if bad.parent == own_directory:
                _set_aside(bad)
        return result, path
    raise ConfigError(
        f"{key}: no readable checkpoint ({len(damaged)} tried; the newest: "
        f"{damaged[0][1]}); point {key} at a good copy, or start fresh with "
        "checkpoint.resume=never checkpoint.overwrite=true"
    )


def _set_aside(path: Path) -> None:
    target = path.with_name(f"{path.name}.corrupted")
    suffix = 1
    while target.exists():
        suffix += 1
        target = path.with_name(f"{path.name}.corrupted-{suffix}")
    if jax.process_index() == 0:
        path.rename(target)
        log.warning("moved the damaged checkpoint %s aside to %s", path, target)
    _sync_processes("meshtrain_checkpoint_set_aside")


def checkpoints_at(key: str, value: str) -> tuple[Path, ...]:
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
    if ckpt.resume not in choices(ResumeMode):
        return _Source(
            "resume", "checkpoint.resume", checkpoints_at("checkpoint.resume", ckpt.resume)
        )
    if ckpt.resume == "auto":
        own = tuple(directory / str(step) for step in reversed(committed_steps(directory)))
        if own:
            return _Source("resume", "checkpoint.resume", own)
    return _Source("fresh", "checkpoint.resume")


def check_params(key: str, path: Path, abstract_params: Any) -> None:
    """Raises ConfigError naming `key` if the checkpoint at `path` holds another model's
    parameters (the first that differs, with both shapes)."""
    mismatch = first_param_mismatch(saved_params(path), abstract_params)
    if mismatch:
        raise ConfigError(
            f"{key}: {path} was written for another model: {mismatch}; use the model "
            "config it was trained with (saved in its meta/), or start fresh with "
            "checkpoint.resume=never"
        )


def _check_state(source: _Source, abstract_params: Any, abstract_rest: Any) -> _Source:
    """Compares the newest candidate that has a readable description with this run's model and
    optimizer state; damaged ones are left for restore_or_init to report and skip."""
    for path in source.candidates:
        try:
            meta = read_meta(path)
            check_params(source.key, path, abstract_params)
        except CorruptCheckpoint:
            continue
        mismatch = first_state_mismatch(meta, abstract_rest)
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
