"""Host values as global arrays: an array every process holds whole (the same on each) laid out
over a mesh that may span processes, each device reading its own slice."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding


def global_array(array: np.ndarray | np.generic, sharding: NamedSharding) -> jax.Array:
    """`array`, the same on every process, as a global array laid out by `sharding`."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
