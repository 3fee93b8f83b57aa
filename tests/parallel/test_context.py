"""The context layout: each cp device holds an early and a late chunk of every sequence, so that
causal attention's work is the same on every device; its order and inverse; lengths it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.config.schema import DEFAULT_LOGICAL_AXIS_RULES
from meshtrain.errors import ConfigError
from meshtrain.parallel.context import (
    ContextLayout,
    check_context_length,
    context_layout,
    split_sequences,
)
from meshtrain.parallel.mesh import build_mesh, parse_mesh_shape


def test_each_device_holds_an_early_and_a_late_chunk():
    layout = ContextLayout(shards=2, length=8)
    assert layout.chunk == 2
    assert [layout.chunks(s) for s in range(2)] == [(0, 3), (1, 2)]
    np.testing.assert_array_equal(layout.order, [0, 1, 6, 7, 2, 3, 4, 5])
    x = jnp.arange(2 * 8).reshape(2, 8)
    np.testing.assert_array_equal(layout.to_layout(x), np.asarray(x)[:, layout.order])
    np.testing.assert_array_equal(layout.to_sequence(layout.to_layout(x)), x)


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_causal_work_differs_by_under_10_percent_across_devices(shards):
    """The (query, key) pairs causal attention computes per cp device, counted from the chunk
    layout: equal on every device, where a contiguous split of the sequence gives the last
    device (2·cp - 1)× the first's."""
    layout = ContextLayout(shards=shards, length=32768)
    work = [layout.visible_pairs(s) for s in range(shards)]
    assert max(work) / min(work) - 1 < 0.10
    assert max(work) == min(work)  # exactly: c²(2·cp - 1) + c(c + 1) pairs each
    c = layout.chunk
    assert work[0] == c * c * (2 * shards - 1) + c * (c + 1)
    assert sum(work) == 32768 * 32769 // 2  # every pair of the sequence, once
    contiguous = [
        sum(q + 1 for q in range(s * 32768 // shards, (s + 1) * 32768 // shards))
        for s in range(shards)
    ]
    assert contiguous[-1] / contiguous[0] > 2 * shards - 1.5


def test_a_length_that_does_not_split_into_two_chunks_per_device_is_one_line():
    with pytest.raises(ConfigError) as err:
        check_context_length(1000, 8)
    assert str(err.value) == (
        "data.seq_len=1000 does not split into 2×cp=16 equal chunks (context parallelism gives "
        "each cp device an early and a late chunk); use a multiple of 16, e.g. data.seq_len=992"
    )
    check_context_length(1024, 8)
    check_context_length(1001, 1)  # no cp: any length


def test_sequences_split_over_cp_on_a_mesh():
    mesh = build_mesh(parse_mesh_shape([[2, 4], ["fsdp", "cp"]], 8))
    rules = DEFAULT_LOGICAL_AXIS_RULES
    tokens = jnp.arange(4 * 64, dtype=jnp.int32).reshape(4, 64)
    with jax.set_mesh(mesh):
        assert context_layout(64, rules) == ContextLayout(4, 64, ("cp",))
        assert context_layout(60, rules) is None  # not 8 chunks: run whole (training refuses it)

        laid_out, none = jax.jit(lambda tokens: split_sequences(rules, tokens, None))(tokens)
    assert none is None
    order = ContextLayout(4, 64).order
    np.testing.assert_array_equal(laid_out, np.asarray(tokens)[:, order])
    assert laid_out.sharding.spec[1] == "cp"
    assert context_layout(64, rules) is None  # outside a mesh
