"""Checkpoints: orbax, asynchronous, atomic, verified, restorable onto any mesh (docs/checkpointing.md).

A checkpoint holds any two pytrees of arrays (parameters and the rest of a state) with their
abstract targets; this package knows nothing of training.
"""

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
