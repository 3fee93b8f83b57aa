"""Device batches one step ahead: the same batches as the host iterator, and a position that
names the next batch the loop takes, not the one read ahead."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.train.batch import DeviceBatches, process_rows


class Counting:
    """A host batch iterator whose step k is filled with k: [accum 1, rows 8, 4]."""

    global_batch = 8

    def __init__(self):
        self.step = 0

    def __next__(self) -> np.ndarray:
        self.step += 1
        return np.full((1, 8, 4), self.step - 1, np.int32)

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = state["step"]


def device_batches() -> tuple[DeviceBatches, NamedSharding]:
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])
    sharding = NamedSharding(mesh, P(None, "fsdp"))
    assert process_rows(sharding, (1, 8, 4), axis=1) == slice(0, 8)
    return DeviceBatches(Counting(), sharding, (1, 8, 4)), sharding


def test_batches_arrive_in_order_sharded():
    batches, sharding = device_batches()
    assert batches.global_batch == 8
    for k in range(3):
        batch = next(batches)
        assert batch.sharding == sharding and batch.shape == (1, 8, 4)
        np.testing.assert_array_equal(np.asarray(batch), np.full((1, 8, 4), k))


def test_read_ahead_batch_is_not_in_the_saved_position():
    batches, _ = device_batches()
    next(batches)
    next(batches)
    assert batches.get_state() == {"step": 2}
    batches.prefetch()  # batch 2 read and sent, not yet trained on
    batches.prefetch()  # a second call reads nothing more
    assert batches.get_state() == {"step": 2}
    np.testing.assert_array_equal(np.asarray(next(batches)), np.full((1, 8, 4), 2))
    assert batches.get_state() == {"step": 3}


def test_set_state_drops_the_batch_read_ahead():
    batches, _ = device_batches()
    batches.prefetch()
    batches.set_state({"step": 7})
    np.testing.assert_array_equal(np.asarray(next(batches)), np.full((1, 8, 4), 7))
