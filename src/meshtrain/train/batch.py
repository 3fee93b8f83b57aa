"""Global batch arrays assembled from the rows each process reads itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding


def process_rows(sharding: NamedSharding, global_shape: Sequence[int], axis: int) -> slice:
    """The contiguous range of `axis` that this process's devices hold.

    Batch axes are the outer mesh axes and jax places each process's devices in one block of
    them, so the range is contiguous; anything else is a bug worth stopping for.
    """
    index_map = sharding.addressable_devices_indices_map(tuple(global_shape))
    ranges = {index[axis].indices(global_shape[axis])[:2] for index in index_map.values()}
    start, stop = min(r[0] for r in ranges), max(r[1] for r in ranges)
    covered = sum(hi - lo for lo, hi in ranges)
    if covered < stop - start:
        raise RuntimeError(
            f"process {jax.process_index()} holds non-contiguous batch rows {sorted(ranges)}"
        )
    return slice(start, stop)


def to_global_array(
    local: np.ndarray, sharding: NamedSharding, global_shape: Sequence[int]
) -> jax.Array:
    """One jax.Array over all processes from this process's rows (no host-side global batch)."""
    return jax.make_array_from_process_local_data(sharding, local, tuple(global_shape))


class BatchSource(Protocol):
    """What the loop, the checkpoints and the step's record read from the train batches:
    DeviceBatches (a dataset's), meshtrain.rl.rollouts.RolloutBatches (sampled completions)."""

    global_batch: int

    def __next__(self) -> jax.Array: ...
    def prefetch(self) -> None: ...
    def follow(self, state: Any) -> None: ...
    def logged(self, step: int) -> dict[str, float]: ...
    def position(self, step: int) -> int: ...
    def get_state(self) -> dict: ...
    def set_state(self, state: dict) -> None: ...


class DeviceBatches:
    """The train batches as global device arrays, read one step ahead.

    The loop calls `prefetch()` right after dispatching step k, so batch k+1 is read on the host
    and its transfer to the devices is queued while they compute step k, before any log step
    waits for metrics. `get_state` reports the position of the next batch the loop will take,
    not the one read ahead, so a checkpoint resumes on exactly the batch that was not trained on.
    """

    def __init__(self, batches: Any, sharding: NamedSharding, global_shape: Sequence[int]):
        self._batches = batches  # yields this process's rows; has get_state and set_state
        self.global_batch: int = batches.global_batch  # sequences per step, all processes
        self._sharding = sharding
        self._global_shape = tuple(global_shape)
        self._ahead: jax.Array | None = None
        self._state_before_ahead: dict | None = None

    def __iter__(self) -> DeviceBatches:
        return self

    def __next__(self) -> jax.Array:
        self.prefetch()
        batch, self._ahead, self._state_before_ahead = self._ahead, None, None
        return batch

    def prefetch(self) -> None:
        """Reads the next batch and starts its transfer, unless that is done already."""
        if self._ahead is None:
            self._state_before_ahead = self._batches.get_state()
            self._ahead = to_global_array(next(self._batches), self._sharding, self._global_shape)

    def follow(self, state: Any) -> None:
        """Nothing: a dataset's batches do not depend on the policy (a policy-gradient run's
        do: meshtrain.rl.rollouts.RolloutBatches)."""

    def logged(self, step: int) -> dict[str, float]:
        """What the step's record logs of its batch: data_share/<source>, each mixture source's
        share of the sequences of steps 1..step, as drawn (BatchIterator.shares; the steps
        before a resume included)."""
        return {f"data_share/{name}": share for name, share in self._batches.shares(step).items()}

    def position(self, step: int) -> int:
        """The stream position of iterator step `step`'s first sequence (BatchIterator)."""
        return self._batches.position(step)

    def get_state(self) -> dict:
        if self._state_before_ahead is not None:
            return self._state_before_ahead
        return self._batches.get_state()

    def set_state(self, state: dict) -> None:
        self._ahead, self._state_before_ahead = None, None
        self._batches.set_state(state)
