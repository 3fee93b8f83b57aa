"""grouped_matmul against jax.lax.ragged_dot: the output and the gradients w.r.t. lhs and rhs
for empty groups, one group holding every row, rows past the groups', sizes a block does not
divide; bf16; traced group sizes under jit; vmap; the inputs it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.models.grouped import grouped_matmul

K, N = 5, 7


def _inputs(sizes, rows, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((rows, K)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), K, N)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _loss(matmul):
    """A scalar of the product whose gradient differs from row to row and column to column."""
    weights = jnp.asarray(np.random.default_rng(1).standard_normal(N), jnp.float32)
    return lambda lhs, rhs, sizes: jnp.sum(jnp.sin(matmul(lhs, rhs, sizes)) * weights)


CASES = {
    "uneven, an empty group": ([3, 0, 9, 4, 0], 16, 4),
    "one group holds every row": ([0, 23, 0], 23, 8),
    "rows past the groups give zeros": ([2, 5, 1], 14, 4),
    "no row in any group": ([0, 0], 6, 4),
    "a sum past M cuts the last groups": ([6, 6, 6], 10, 4),
    "one row per group, a block of 1": ([1, 1, 1, 1], 4, 1),
    "random sizes, block 3": (list(np.random.default_rng(2).multinomial(37, [0.25] * 4)), 40, 3),
}


def _output_and_grads(matmul):
    """One compiled program: matmul's output and _loss's gradients w.r.t. lhs and rhs."""

    @jax.jit
    def run(lhs, rhs, sizes):
        grads = jax.grad(_loss(matmul), argnums=(0, 1))(lhs, rhs, sizes)
        return matmul(lhs, rhs, sizes), grads

    return run


@pytest.mark.parametrize(("sizes", "rows", "block"), CASES.values(), ids=CASES.keys())
def test_output_and_gradients_equal_ragged_dots(sizes, rows, block):
    lhs, rhs, group_sizes = _inputs(sizes, rows)

    def grouped(lhs, rhs, sizes):
        return grouped_matmul(lhs, rhs, sizes, block=block)

    got, grads = _output_and_grads(grouped)(lhs, rhs, group_sizes)
    expected, expected_grads = _output_and_grads(jax.lax.ragged_dot)(lhs, rhs, group_sizes)
    assert got.shape == (rows, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    counted = min(sum(sizes), rows)
    np.testing.assert_array_equal(got[counted:], 0.0)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.shape == expected_grad.shape and grad.dtype == jnp.float32
        np.testing.assert_allclose(grad, expected_grad, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(grads[0][counted:], 0.0)  # rows past the groups: no gradient


def test_a_few_rows_over_many_groups_equal_ragged_dots():
    """M / G below a block shrinks the block (to 8 here): still ragged_dot's numbers."""
    sizes = [0] * 30 + [3, 0, 5] + [1] * 31
    lhs, rhs, group_sizes = _inputs(sizes, 40)
    np.testing.assert_allclose(
        jax.jit(grouped_matmul)(lhs, rhs, group_sizes),
        jax.lax.ragged_dot(lhs, rhs, group_sizes),
        atol=1e-5,
        rtol=1e-5,
    )


def test_bf16_gives_ragged_dots_dtype_and_close_values():
    lhs, rhs, group_sizes = _inputs([4, 0, 7, 5], 17, dtype=jnp.bfloat16)
    expected = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    got = jax.jit(grouped_matmul, static_argnames="block")(lhs, rhs, group_sizes, block=4)
    assert got.dtype == expected.dtype == jnp.bfloat16
    exact = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes)
    np.testing.assert_allclose(got.astype(jnp.float32), exact, atol=0.05, rtol=0.02)
    np.testing.assert_allclose(got.astype(jnp.float32), expected.astype(jnp.float32), atol=0.05)
    d_lhs, d_rhs = jax.jit(jax.grad(_loss(grouped_matmul), argnums=(0, 1)))(lhs, rhs, group_sizes)
    assert d_lhs.dtype == d_rhs.dtype == jnp.bfloat16
    # Mixed dtypes promote, as ragged_dot does.
    rhs = rhs.astype(jnp.float32)
    mixed = jax.eval_shape(grouped_matmul, lhs, rhs, group_sizes).dtype
    assert mixed == jax.eval_shape(jax.lax.ragged_dot, lhs, rhs, group_sizes).dtype == jnp.float32


def test_jit_with_traced_group_sizes_compiles_once():
    lhs, rhs, _ = _inputs([0, 0, 0], 12)
    traces = []

    @jax.jit
    def value_and_grads(lhs, rhs, sizes):
        traces.append(None)
        return jax.value_and_grad(_loss(grouped_matmul), argnums=(0, 1))(lhs, rhs, sizes)

    reference = jax.value_and_grad(_loss(jax.lax.ragged_dot), argnums=(0, 1))
    for sizes in ([12, 0, 0], [0, 5, 7], [2, 3, 1], [0, 0, 0]):
        group_sizes = jnp.asarray(sizes, jnp.int32)
        got, expected = value_and_grads(lhs, rhs, group_sizes), reference(lhs, rhs, group_sizes)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert len(traces) == 1


def test_vmap_over_a_batch_with_its_own_group_sizes():
    lhs, rhs, _ = _inputs([0, 0, 0], 12)
    lhs_batch = jnp.stack([lhs, 2 * lhs])
    sizes = jnp.asarray([[4, 4, 4], [0, 9, 1]], jnp.int32)
    got = jax.jit(jax.vmap(lambda x, s: grouped_matmul(x, rhs, s, block=4)))(lhs_batch, sizes)
    for i in range(2):
        np.testing.assert_allclose(
            got[i], jax.lax.ragged_dot(lhs_batch[i], rhs, sizes[i]), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize(
    ("lhs_shape", "rhs_shape", "sizes_shape", "block"),
    [((4, 5), (2, 5, 3), (3,), 4), ((4, 6), (2, 5, 3), (2,), 4), ((4, 5), (2, 5, 3), (2,), 0)],
)
def test_refuses_mismatched_shapes_and_a_block_below_one(lhs_shape, rhs_shape, sizes_shape, block):
    with pytest.raises(ValueError):
        grouped_matmul(
            jnp.zeros(lhs_shape),
            jnp.zeros(rhs_shape),
            jnp.zeros(sizes_shape, jnp.int32),
            block=block,
        )
