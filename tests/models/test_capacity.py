"""Capacity mode's routing (models.capacity): the capacity, each assignment's slot, and the
buffers it fills and reads back."""

import jax.numpy as jnp
import numpy as np

from meshtrain.models.capacity import CapacityRouting, expert_capacity


def test_expert_capacity_rounds_up_and_stops_at_the_token_count():
    assert expert_capacity(1.25, 16, 2, 4) == 10
    assert expert_capacity(1.1, 100, 2, 4) == 55  # 1.1 · 100 · 2 / 4 is 55.00000000000001
    assert expert_capacity(1.0, 7, 2, 4) == 4
    assert expert_capacity(8.0, 16, 2, 4) == 16


def test_each_sequence_fills_its_own_slots_first_come_first_served():
    """2 sequences of 3 tokens, 2 picks each, 3 experts, capacity 2: in the first, expert 0 is
    picked by tokens 0, 1 and 2, so token 2's pick is dropped; the second sequence starts its
    own queues, and there expert 2's third pick is dropped. dispatch puts each kept row at [expert, sequence · C + slot]; combine reads
    them back and gives zeros for the dropped."""
    experts = jnp.array([[0, 1], [0, 2], [0, 1], [2, 1], [2, 0], [2, 1]], jnp.int32)  # [N, K]
    routing = CapacityRouting.of(experts, length=3, capacity=2, num_experts=3)
    np.testing.assert_array_equal(routing.slots, [[0, 0, 1, 0, 2, 1], [0, 0, 1, 0, 2, 1]])
    assert int(routing.dropped) == 2
    rows = jnp.arange(12, dtype=jnp.float32)[:, None] + 1  # [M, 1]: assignment m holds m + 1
    buffer = routing.dispatch(rows)  # [E, S·C, 1]
    np.testing.assert_array_equal(
        buffer[..., 0],
        [[1, 3, 10, 0], [2, 6, 8, 12], [4, 0, 7, 9]],
    )
    kept = np.where(np.asarray(routing.slots).reshape(-1) < 2, np.arange(1, 13), 0)
    np.testing.assert_array_equal(routing.combine(buffer)[:, 0], kept)
