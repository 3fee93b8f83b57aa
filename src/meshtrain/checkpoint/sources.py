"""What a run starts from: the checkpoints to resume, newest first, checked against this run's
config, model and optimizer state before anything is compiled (RunCheckpoints.open)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.layout import (
    CorruptCheckpoint,
    committed_steps,
    find_checkpoints,
    first_param_mismatch,
    first_state_mismatch,
    read_meta,
    saved_params,
)
from meshtrain.config.schema import CheckpointConfig, ResumeMode, choices
from meshtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Source:
    """What the run starts from: checkpoints to try newest first, or nothing (a fresh init)."""

    kind: str  # "resume" (the whole state) or "fresh"
    key: str  # the config key that named the source, for messages
    candidates: tuple[Path, ...] = ()
    start_step: int = 0  # the step of the newest candidate with a readable description


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


def _choose_source(ckpt: CheckpointConfig, directory: Path) -> Source:
    if ckpt.resume not in choices(ResumeMode):
        return Source(
            "resume", "checkpoint.resume", checkpoints_at("checkpoint.resume", ckpt.resume)
        )
    if ckpt.resume == "auto":
        own = tuple(directory / str(step) for step in reversed(committed_steps(directory)))
        if own:
            return Source("resume", "checkpoint.resume", own)
    return Source("fresh", "checkpoint.resume")


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


def checked_source(
    cfg: CheckpointConfig,
    directory: Path,
    abstract_params: Any,
    abstract_rest: Any,
    steps: int,
    check_meta: Callable[[dict[str, Any], Path], None] | None,
) -> Source:
    """What the run starts from, checked against this run (RunCheckpoints.open)."""
    source = _choose_source(cfg, directory)
    if source.candidates:
        source = _check_state(source, abstract_params, abstract_rest, check_meta)
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
        raise ConfigError(later_steps_message(cfg, directory, later, source.start_step))
    return source


def _check_state(
    source: Source,
    abstract_params: Any,
    abstract_rest: Any,
    check_meta: Callable[[dict[str, Any], Path], None] | None,
) -> Source:
    """Compares the newest candidate that has a readable description with this run (its config
    through `check_meta`, then its model and optimizer state); damaged ones are left for
    restore_or_init to report and skip."""
    for path in source.candidates:
        try:
            meta = read_meta(path)
            if check_meta is not None:
                check_meta(meta, path)
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


def later_steps_message(
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
