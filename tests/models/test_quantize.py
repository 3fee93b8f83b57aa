"""Block quantisation (QLoRA's frozen base): int8 and nf4 codes are the formats' own numbers,
the round trip stays within each format's half-step, all-zero blocks come back as zeros, and
quantising under jit on a sharded weight gives the unsharded bits; the weight reads through
an nnx.Param as the model reads it (`self.q[...]`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.models.quantize import (
    NF4_LEVELS,
    Quantized,
    block_error,
    dequantize,
    pack_nibbles,
    quantize,
    quantized_shapes,
    storage_bytes,
    unpack_nibbles,
)

# Half the widest gap between neighbouring NF4 levels (the one from -1 to -0.696): the largest
# error of a nearest-level code, in units of the block's absmax.
NF4_HALF_GAP = float(np.max(np.diff(NF4_LEVELS)) / 2)
SHAPES = [((64, 4, 16), 0), ((4, 16, 64), 2), ((16, 64), -1)]


def normal(shape, seed=0, dtype=jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def per_element_absmax(w: np.ndarray, block: int, axis: int) -> np.ndarray:
    """Each element's block absmax, [*shape], computed by numpy."""
    axis = axis % w.ndim
    blocks = w.reshape(*w.shape[:axis], -1, block, *w.shape[axis + 1 :])
    absmax = np.abs(blocks).max(axis=axis + 1, keepdims=True)
    return np.broadcast_to(absmax, blocks.shape).reshape(w.shape)


def nf4_codes(q: Quantized) -> np.ndarray:
    return np.asarray(unpack_nibbles(q.codes, q.axis))


@pytest.mark.parametrize(("shape", "axis"), SHAPES)
def test_int8_round_trip_within_half_a_step(shape, axis):
    w = normal(shape)
    q = quantize(w, "int8", 16, axis)
    assert q.codes.dtype == jnp.int8 and q.codes.shape == shape
    absmax = per_element_absmax(np.asarray(w), 16, axis)
    expanded = np.repeat(np.asarray(q.absmax), 16, axis=axis)  # [*shape]
    np.testing.assert_array_equal(expanded, absmax)
    error = np.abs(np.asarray(q[...]) - np.asarray(w))
    assert np.all(error <= absmax / 254 * (1 + 1e-5))
    assert error.max() > 0.4 * absmax.max() / 254  # the bound is tight, not vacuous


def test_int8_codes_of_hand_made_blocks():
    # Two blocks of 4 along axis 0: absmax 2 and 0.4.
    w = jnp.array([1.0, -2.0, 0.5, 0.0, 0.1, 0.2, -0.4, 0.3], jnp.float32)[:, None]  # [8, 1]
    q = quantize(w, "int8", 4, 0)
    # 127·[0.5, -1, 0.25, 0] and 127·[0.25, 0.5, -1, 0.75], rounded half to even (63.5 -> 64).
    np.testing.assert_array_equal(q.codes[:, 0], [64, -127, 32, 0, 32, 64, -127, 95])
    np.testing.assert_array_equal(q.absmax[:, 0], np.float32([2.0, 0.4]))
    expected = np.float32([64, -127, 32, 0, 32, 64, -127, 95]) * np.repeat(
        np.float32([2.0, 0.4]) / np.float32(127), 4
    )
    np.testing.assert_array_equal(q[...][:, 0], expected)


def test_nf4_levels_map_to_their_own_codes():
    w = jnp.asarray(np.concatenate([3 * NF4_LEVELS, 0.5 * NF4_LEVELS[::-1]]))[None, :]  # [1, 32]
    q = quantize(w, "nf4", 16, 1)
    assert q.codes.shape == (1, 16) and q.codes.dtype == jnp.uint8
    np.testing.assert_array_equal(nf4_codes(q)[0], [*range(16), *range(15, -1, -1)])
    np.testing.assert_array_equal(q.absmax, [[3.0, 0.5]])


@pytest.mark.parametrize(("shape", "axis"), SHAPES)
def test_nf4_codes_are_the_nearest_levels(shape, axis):
    w = normal(shape, seed=1)
    q = quantize(w, "nf4", 16, axis)
    codes = nf4_codes(q)
    absmax = per_element_absmax(np.asarray(w), 16, axis)
    scaled = np.asarray(w) / absmax  # fp32, as quantize divides
    brute_force = np.argmin(np.abs(scaled[..., None] - NF4_LEVELS), axis=-1)
    np.testing.assert_array_equal(codes, brute_force)
    # Every value read back is exactly its level times its block's absmax (one fp32 product).
    np.testing.assert_array_equal(q[...], NF4_LEVELS[codes] * absmax)
    error = np.abs(np.asarray(q[...]) - np.asarray(w))
    assert np.all(error <= NF4_HALF_GAP * absmax * (1 + 1e-6))


def test_nf4_packing_round_trips_in_bitsandbytes_order():
    codes = jnp.array([[1, 2], [15, 0], [7, 9], [0, 15]], jnp.uint8)  # [4, 2]
    packed = pack_nibbles(codes, 0)  # [2, 2]: element 2i high, 2i+1 low
    np.testing.assert_array_equal(packed, [[0x1F, 0x20], [0x70, 0x9F]])
    np.testing.assert_array_equal(unpack_nibbles(packed, 0), codes)
    every = jax.random.randint(jax.random.key(2), (6, 32, 4), 0, 16).astype(jnp.uint8)
    np.testing.assert_array_equal(unpack_nibbles(pack_nibbles(every, 1), 1), every)


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_an_all_zero_block_comes_back_as_zeros(fmt):
    w = normal((32, 8)).at[16:, 3].set(0.0)  # the second block of column 3 is all zero
    q = quantize(w, fmt, 16, 0)
    assert q.absmax[1, 3] == 0
    read = np.asarray(q[...])
    assert not np.isnan(read).any()
    np.testing.assert_array_equal(read[16:, 3], np.zeros(16, np.float32))
    zeros = quantize(jnp.zeros((4, 4)), fmt, 4, 1)
    np.testing.assert_array_equal(zeros[...], np.zeros((4, 4), np.float32))


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_the_result_follows_dtype_and_astype(fmt):
    w = normal((64, 8))
    q32 = quantize(w, fmt, 32, 0)
    assert q32.dtype == jnp.float32 and q32[...].dtype == jnp.float32
    q16 = q32.astype(jnp.bfloat16)
    assert q16.codes is q32.codes and q16.absmax is q32.absmax
    assert q16[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(q16[...], q32[...].astype(jnp.bfloat16))
    from_bf16 = quantize(w.astype(jnp.bfloat16), fmt, 32, 0)
    assert from_bf16[...].dtype == jnp.bfloat16
    assert quantize(w.astype(jnp.bfloat16), fmt, 32, 0, dtype=jnp.float32)[...].dtype == (
        jnp.float32
    )
    assert q32.ndim == 2 and q32.shape == (64, 8)


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
@pytest.mark.parametrize(("shape", "axis", "block"), [((512, 32), 0, 64), ((64, 4, 16), 2, 8)])
def test_sharded_under_jit_gives_the_unsharded_bits(fmt, shape, axis, block):
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    w = normal(shape, seed=3)
    sharded = jax.device_put(w, NamedSharding(mesh, P("x")))
    round_trip = jax.jit(lambda w: quantize(w, fmt, block, axis)[...])
    q = jax.jit(lambda w: quantize(w, fmt, block, axis))(sharded)
    reference = quantize(w, fmt, block, axis)
    np.testing.assert_array_equal(q.codes, reference.codes)
    np.testing.assert_array_equal(q.absmax, reference.absmax)
    np.testing.assert_array_equal(round_trip(sharded), reference[...])
    assert len(q.codes.sharding.device_set) == 8  # still spread over the mesh, not gathered
    assert q.codes.addressable_shards[0].data.size == q.codes.size // 8


def test_read_through_an_nnx_param_eagerly_and_under_jit():
    w = normal((64, 16), seed=4)
    q = quantize(w, "nf4", 32, 0, dtype=jnp.bfloat16)
    p = nnx.Param(q)
    np.testing.assert_array_equal(p[...], dequantize(q))
    assert p[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(jax.jit(lambda q: q[...])(q), dequantize(q))

    class Proj(nnx.Module):
        def __init__(self):
            self.q = nnx.Param(q)

        def __call__(self, x):
            return x @ self.q[...]  # [B, 64] @ [64, 16]

    x = normal((2, 64), seed=5, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(Proj(), x), x @ dequantize(q))
    with pytest.raises(IndexError, match=r"read whole"):
        q[0]


def test_stacked_layers_read_whole_and_inside_a_scan():
    w = normal((3, 64, 16), seed=6)  # [layers, in, out]
    stacked = jax.vmap(lambda w: quantize(w, "nf4", 16, 0))(w)
    assert stacked.codes.shape == (3, 32, 16) and stacked.absmax.shape == (3, 4, 16)
    per_layer = np.stack([quantize(w[i], "nf4", 16, 0)[...] for i in range(3)])
    np.testing.assert_array_equal(stacked[...], per_layer)
    _, scanned = jax.lax.scan(lambda c, q: (c, q[...]), 0, stacked)
    np.testing.assert_array_equal(scanned, per_layer)
    # The stacked weight quantised whole along its input axis 1, then sliced by the scan: the
    # same codes, and each layer reads back as that layer.
    whole = quantize(w, "nf4", 16, 1)
    np.testing.assert_array_equal(whole.codes, stacked.codes)
    np.testing.assert_array_equal(whole[...], per_layer)
    _, scanned = jax.lax.scan(lambda c, q: (c, q[...]), 0, whole)
    np.testing.assert_array_equal(scanned, per_layer)


def test_block_error_names_the_sizes_and_the_nearest_blocks():
    assert block_error((640, 2048), "nf4", 64, 0) is None
    assert block_error((640, 2048), "int8", 5, 0) is None
    assert block_error((2048, 640), "int8", 40, -1) is None
    assert block_error((640, 2048), "nf4", 48, 0) == (
        "model.lora.quant_block=48 does not divide the input size 640 (axis 0 of a weight of "
        "shape (640, 2048)); use 40 or 64"
    )
    assert block_error((4, 96, 8), "nf4", 33, 1) == (
        "model.lora.quant_block=33 is odd, and nf4 packs two 4-bit codes per byte within a "
        "block; use 32 or 48"
    )
    assert block_error((96,), "int8", 1, 0) == "model.lora.quant_block=1 must be at least 2; use 2"
    assert block_error((5, 3), "nf4", 2, 0, key="quant_block") == (
        "quant_block=2 does not divide the input size 5 (axis 0 of a weight of shape (5, 3)); "
        "no block fits: it must be at least 2, even and divide 5"
    )
    with pytest.raises(ValueError, match=r"quant_block=48 does not divide the input size 640"):
        quantize(jnp.zeros((640, 8)), "nf4", 48, 0)


def test_shapes_and_bytes_without_computing():
    shape = (2048, 8192)
    assert quantized_shapes(shape, "nf4", 64, 0) == ((1024, 8192), (32, 8192))
    assert quantized_shapes(shape, "int8", 64, 1) == ((2048, 8192), (2048, 128))
    assert storage_bytes(shape, "nf4", 64, 0) == 1024 * 8192 + 4 * 32 * 8192  # 9 MiB
    assert storage_bytes(shape, "int8", 64, 0) == 2048 * 8192 + 4 * 32 * 8192  # 17 MiB
    # The arrays quantize would make: shapes and dtypes traced only.
    spec = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    q = jax.eval_shape(lambda w: quantize(w, "nf4", 64, 0), spec)
    assert (q.codes.shape, q.codes.dtype) == ((1024, 8192), jnp.uint8)
    assert (q.absmax.shape, q.absmax.dtype) == ((32, 8192), jnp.float32)
    assert q.dtype == jnp.bfloat16 and q.shape == shape
