"""Attention across a sequence split over cp equals attention over the whole sequence, outputs
and gradients, for cp = 2, 4 and 8, on causal, windowed and packed multi-document masks, with
grouped-query heads down to a single key/value head, with the kernels that run on a CPU."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models.test_attention import _inputs, einsum_attention

from meshtrain.config.schema import DEFAULT_LOGICAL_AXIS_RULES
from meshtrain.errors import ConfigError
from meshtrain.models import context_attention
from meshtrain.models.attention import WindowOfKind
from meshtrain.models.attention_choice import check_attention, select_attention
from meshtrain.models.context_attention import context_parallel_attention
from meshtrain.parallel.context import ContextLayout
from meshtrain.parallel.mesh import build_mesh, parse_mesh_shape
from meshtrain.parallel.rules import constrain

LENGTH = 128


def _segments(batch: int, length: int, seed: int = 1) -> jnp.ndarray:
    """Packed documents: segment ids that start a new document at random places."""
    starts = np.random.default_rng(seed).random((batch, length)) < 0.02
    starts[:, 0] = True
    return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


def _split_attention(mesh_shape, q, k, v, *, kernel, window, segment_ids, fsdp_axes=()):
    """Attention of q, k, v (in sequence order) run over cp: the inputs put in the context
    layout and split over cp (and the batch over fsdp), the output put back in order."""
    mesh = build_mesh(parse_mesh_shape(mesh_shape, 8))
    shards = mesh.shape["cp"]
    layout = ContextLayout(shards, q.shape[1])
    rules = DEFAULT_LOGICAL_AXIS_RULES

    def run(q, k, v, segment_ids):
        q, k, v = (
            constrain(layout.to_layout(a), ("batch", "length", None, None), rules)
            for a in (q, k, v)
        )
        segments = None if segment_ids is None else layout.to_layout(segment_ids)
        out = context_parallel_attention(
            q,
            k,
            v,
            layout=layout,
            kernel=kernel,
            scale=0.3,
            window=window,
            segment_ids=segments,
            batch_axes=fsdp_axes,
            manual_axes=fsdp_axes,
        )
        return layout.to_sequence(out)

    def out_and_grads(q, k, v, segment_ids):
        out, pullback = jax.vjp(lambda q, k, v: run(q, k, v, segment_ids), q, k, v)
        return out, pullback(jnp.cos(out))  # the gradients of sum(sin(out))

    with jax.set_mesh(mesh):
        return jax.jit(out_and_grads)(q, k, v, segment_ids)


@partial(jax.jit, static_argnames="window")
def _oracle(q, k, v, segment_ids, *, window):
    """The einsum oracle's output and the gradients of sum(sin(output)), in one program."""

    def oracle(q, k, v):
        return einsum_attention(q, k, v, scale=0.3, window=window, segment_ids=segment_ids)

    grads = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(oracle(q, k, v))), (0, 1, 2))(q, k, v)
    return oracle(q, k, v), grads


def _assert_equals_the_oracle(out, grads, q, k, v, *, window, segment_ids):
    """out and the gradients of sum(sin(out)) are the einsum oracle's, to 1e-5."""
    want_out, expected = _oracle(q, k, v, segment_ids, window=window)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


CASES = [
    # (mesh, kernel, window, segments, kv_heads)
    pytest.param([[2, 4], ["cp", "fsdp"]], "chunked", None, False, 2, marks=pytest.mark.slow),
    ([[4, 2], ["cp", "fsdp"]], "chunked", 40, True, 1),
    pytest.param([[8], ["cp"]], "chunked", None, True, 1, marks=pytest.mark.slow),  # 12 s
    pytest.param([[8], ["cp"]], "xla", 24, False, 2, marks=pytest.mark.slow),
    pytest.param([[2, 4], ["cp", "fsdp"]], "xla", None, True, 4, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("mesh_shape", "kernel", "window", "segments", "kv_heads"), CASES)
def test_split_attention_equals_whole_sequence_attention(
    mesh_shape, kernel, window, segments, kv_heads
):
    q, k, v = _inputs(4, kv_heads, length=LENGTH, batch=4)
    segment_ids = _segments(4, LENGTH) if segments else None
    fsdp = ("fsdp",) if "fsdp" in mesh_shape[1] else ()
    out, grads = _split_attention(
        mesh_shape, q, k, v, kernel=kernel, window=window, segment_ids=segment_ids, fsdp_axes=fsdp
    )
    _assert_equals_the_oracle(out, grads, q, k, v, window=window, segment_ids=segment_ids)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.slow
def test_long_sequences_run_in_small_recomputed_blocks(monkeypatch, window):
    """With a score budget that fits 16 queries, the chunks run in looped blocks of 16 whose
    scores are recomputed in the backward pass: the same outputs and gradients."""
    monkeypatch.setattr(context_attention, "SCORE_BYTES", 4 * 4 * 4 * LENGTH * 16)
    layout = ContextLayout(2, LENGTH)
    assert context_attention.context_block(layout, batch=4, heads=4) == 16
    q, k, v = _inputs(4, 2, length=LENGTH, batch=4)
    segment_ids = _segments(4, LENGTH)
    out, grads = _split_attention(
        [[2, 4], ["cp", "fsdp"]],
        q,
        k,
        v,
        kernel="chunked",
        window=window,
        segment_ids=segment_ids,
        fsdp_axes=("fsdp",),
    )
    _assert_equals_the_oracle(out, grads, q, k, v, window=window, segment_ids=segment_ids)


@pytest.mark.slow  # 10 s; the Gemma 3 model runs it in tests/train/test_context_parallel.py
def test_a_traced_layer_kind_picks_its_window_under_cp():
    """Gemma 3's mixed layers in a scan: the kind is traced, each branch runs its own window."""
    q, k, v = _inputs(4, 1, length=LENGTH, batch=4)
    for kind, window in enumerate((16, None)):
        out, _ = _split_attention(
            [[4, 2], ["cp", "fsdp"]],
            q,
            k,
            v,
            kernel="chunked",
            window=WindowOfKind(jnp.int32(kind), (16, None)),
            segment_ids=None,
            fsdp_axes=("fsdp",),
        )
        want = einsum_attention(q, k, v, scale=0.3, window=window)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_cudnn_cannot_run_a_split_sequence_and_auto_picks_chunked():
    kernel, why = select_attention("auto", dtype=jnp.bfloat16, head_dim=64, context_shards=4)
    assert kernel == "chunked"
    assert why == "auto: cp=4, where cuDNN's causal mask cannot offset a chunk's queries"
    with pytest.raises(ConfigError) as err:
        check_attention("cudnn", context_shards=4)
    assert str(err.value) == (
        "model.attention=cudnn cannot attend across a sequence split over cp=4 (cuDNN's causal "
        "mask cannot offset a chunk's queries); use model.attention=auto (the chunked kernel) "
        "or xla"
    )
