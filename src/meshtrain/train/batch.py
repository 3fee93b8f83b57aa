"""Global batch arrays assembled from the rows each process reads itself."""

from __future__ import annotations

from collections.abc import Sequence

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
