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
    state, or one around checkpoint.load_params: meshtrain.weights.initial_weights). A damaged
    newest checkpoint is reported, moved aside to `<step>.corrupted` (never deleted) and the
    previous one is used.
  - never: `init()`; refuses a checkpoint.dir that already holds checkpoints unless
    checkpoint.overwrite=true, which deletes them.
  - a path: that checkpoint, a directory of them, or a run directory.

Saving uses orbax's CheckpointManager: each checkpoint is written under a temporary name and
renamed when complete (a killed write is never listed), and a checkpoint beyond checkpoint.keep is
deleted only after the newer one has committed. All processes call every method here; orbax
writes each array's shards from the processes that hold them. A write the disk fails raises
CheckpointWriteError (meshtrain.checkpoint.writes, also the test hook
MESHTRAIN_TEST_KILL_AFTER_SAVE); from `open` to `close` the run holds the lock of its directory
(meshtrain.checkpoint.lock).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from meshtrain.checkpoint.layout import (
    CorruptCheckpoint,
    committed_steps,
    read_state,
    save_args,
)
from meshtrain.checkpoint.lock import RunLocks
from meshtrain.checkpoint.sources import Source, checked_source, later_steps_message
from meshtrain.checkpoint.writes import OrbaxWrites, maybe_kill_for_test
from meshtrain.config.schema import CheckpointConfig
from meshtrain.errors import ConfigError

log = logging.getLogger(__name__)


class DataPosition(Protocol):
    """Where the input pipeline stands: saved with each checkpoint, set again on resume. Its
    values are JSON, or numpy arrays (kept in the checkpoint's data/ item, read back whole)."""

    global_batch: int

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...


class RunCheckpoints:
    """The checkpoints of one run; use `open`, then as a context manager."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        directory: Path,
        source: Source,
        abstract: tuple[Any, Any],
        run_meta: dict[str, Any],
        locks: RunLocks | None = None,
    ) -> None:
        self.cfg = cfg
        self.directory = directory
        self.source = source
        self.abstract_params, self.abstract_rest = abstract
        self.run_meta = run_meta
        self.last_saved: Path | None = None
        self._manager: ocp.CheckpointManager | None = None
        self._writes = OrbaxWrites(directory, cfg.keep)
        self._locks = locks or RunLocks([])

    @classmethod
    def open(
        cls,
        cfg: CheckpointConfig,
        run_dir: Path,
        abstract_params: Any,
        abstract_rest: Any,
        *,
        steps: int,
        run_meta: dict[str, Any],
        check_meta: Callable[[dict[str, Any], Path], None] | None = None,
    ) -> RunCheckpoints:
        """Checks the checkpoint settings against the disk and the state's structure; raises
        ConfigError (nothing compiled, nothing overwritten) for a value that cannot work.

        The abstract targets carry the shapes and shardings of this run's mesh, so every array
        is read straight into its shards whatever mesh wrote it. `steps` is the run's last step
        (training.steps); the entries of `run_meta` (the run's config, ...) are saved in each
        checkpoint's meta/ beside its step, data position and global batch.
        `check_meta(meta, path)` checks the description of the checkpoint to resume before its
        arrays are compared with the model's (it raises ConfigError for a run that differs).
        """
        # orbax logs each phase of every save at INFO through absl; its warnings still show.
        logging.getLogger("absl").setLevel(logging.WARNING)
        directory = (Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints").resolve()
        # Locked before its checkpoints are read (another run may be pruning them), or, for a
        # directory yet to be made, once the checks pass; nothing is deleted or moved before.
        locks = RunLocks.acquire(directory, Path(run_dir)) if directory.is_dir() else None
        try:
            source = checked_source(
                cfg, directory, abstract_params, abstract_rest, steps, check_meta
            )
            _check_writable(directory)
            locks = locks or RunLocks.acquire(directory, Path(run_dir))
        except BaseException:
            if locks is not None:
                locks.release()
            raise
        return cls(cfg, directory, source, (abstract_params, abstract_rest), run_meta, locks)

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
            log.info("resuming from %s at step %d", path, start)
            data.set_state(meta["data"])
            self.last_saved = path
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
        """Starts writing the state after `step` (in the background with async_save). A write
        the disk fails, this one or the previous, raises CheckpointWriteError naming its step."""
        assert self._manager is not None, "restore_or_init comes first"
        position = data.get_state()  # JSON, and host arrays (saved as their own item)
        arrays = {k: v for k, v in position.items() if isinstance(v, np.ndarray)}
        meta = {
            "step": step,
            "data": {k: v for k, v in position.items() if k not in arrays},
            "global_batch": data.global_batch,
            **self.run_meta,
        }
        self._writes.save(self._manager, step, save_args(params, rest, meta, arrays))
        self.last_saved = self.directory / str(step)
        log.info("checkpoint of step %d → %s", step, self.last_saved)
        maybe_kill_for_test(self._writes, self._manager, step)

    def close(self) -> None:
        """Waits for the last asynchronous write to commit (CheckpointWriteError if the disk
        failed it; after a failed write, waits for nothing) and releases the run's locks."""
        try:
            if self._manager is not None:
                manager, self._manager = self._manager, None
                self._writes.close(manager)
        finally:
            self._locks.release()

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
            raise ConfigError(later_steps_message(self.cfg, self.directory, later, start))
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
    candidates: Sequence[Path],
    read: Callable[[Path], Any],
    *,
    key: str,
    own_directory: Path | None,
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
