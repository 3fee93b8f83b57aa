"""The non-finite guard: a NaN or Inf loss or gradient norm stops the run or skips the update.

The check runs inside the jitted step, so it costs no host round-trip: the step records the
first bad step and its values in the train state (and, with `skip`, keeps the previous
parameters and optimizer state). The host looks at that record only when it already waits for
the device: at log steps and before every checkpoint save, so a bad state is never saved.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class NonfiniteRecord:
    """What the guard has seen so far; part of the train state, so it survives a resume."""

    skipped: jax.Array  # int32 []: updates dropped with training.nonfinite=skip
    first_step: jax.Array  # int32 []: first step with a non-finite loss or grad norm; 0: none
    first_loss: jax.Array  # float32 []: that step's loss
    first_grad_norm: jax.Array  # float32 []: that step's gradient norm


class NonFiniteError(RuntimeError):
    """Training met a NaN or Inf with training.nonfinite=stop; the message names step and values."""


def initial_record() -> NonfiniteRecord:
    return NonfiniteRecord(
        skipped=jnp.zeros((), jnp.int32),
        first_step=jnp.zeros((), jnp.int32),
        first_loss=jnp.zeros((), jnp.float32),
        first_grad_norm=jnp.zeros((), jnp.float32),
    )


def guard_update(
    old: Any, new: Any, record: NonfiniteRecord, *, step: jax.Array, loss, grad_norm, skip: bool
) -> tuple[Any, NonfiniteRecord]:
    """(state to keep, updated record), traced inside the step. `step` is 1-based.

    With skip, the whole update (parameters and optimizer state) is dropped when the step is
    not finite: a `where` over the state, which XLA fuses into the update itself.
    """
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    first = ~finite & (record.first_step == 0)
    record = NonfiniteRecord(
        skipped=record.skipped + (0 if not skip else (~finite).astype(jnp.int32)),
        first_step=jnp.where(first, step, record.first_step),
        first_loss=jnp.where(first, loss, record.first_loss),
        first_grad_norm=jnp.where(first, grad_norm, record.first_grad_norm),
    )
    if skip:
        new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return new, record


def raise_if_nonfinite(record: NonfiniteRecord, mode: str, *, last_saved: str | None) -> None:
    """With mode "stop", raises NonFiniteError if any step so far was not finite (a host sync)."""
    if mode != "stop":
        return
    first_step, loss, grad_norm = jax.device_get(
        (record.first_step, record.first_loss, record.first_grad_norm)
    )
    if int(first_step) == 0:
        return
    saved = f"the last checkpoint is {last_saved}" if last_saved else "no checkpoint was saved"
    raise NonFiniteError(
        f"step {int(first_step)} is not finite: loss={float(loss)!r}, "
        f"grad_norm={float(grad_norm)!r} (training.nonfinite=stop); training stopped and {saved}; "
        "lower training.learning_rate, or set training.nonfinite=skip to drop such updates"
    )
