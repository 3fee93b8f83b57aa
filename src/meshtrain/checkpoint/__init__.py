"""Checkpoints: orbax, asynchronous, atomic, verified, restorable onto any mesh (docs/checkpointing.md)."""

from meshtrain.checkpoint.layout import (
    CorruptCheckpoint,
    committed_steps,
    find_checkpoints,
    named_leaves,
    read_meta,
    read_params,
    read_state,
    saved_params,
)
from meshtrain.checkpoint.manager import RunCheckpoints

__all__ = [
    "CorruptCheckpoint",
    "RunCheckpoints",
    "committed_steps",
    "find_checkpoints",
    "named_leaves",
    "read_meta",
    "read_params",
    "read_state",
    "saved_params",
]
