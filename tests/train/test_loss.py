"""The fused output projection + cross-entropy: the loss and gradients of log_softmax over the
whole logits, in fp32, for any chunking; the same on a sharded mesh, where chunking adds no
reduction of the weight gradient over the batch shards; the model's loss as before."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.config import compose_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.config.schema import DEFAULT_LOGICAL_AXIS_RULES
from meshtrain.models.abstract import abstract_model
from meshtrain.models.transformer import Transformer
from meshtrain.observe.communication import account_collectives
from meshtrain.parallel.mesh import build_mesh, parse_mesh_shape
from meshtrain.train.documents import TokenFormat
from meshtrain.train.loss import output_cross_entropy
from meshtrain.train.objectives.next_token import token_loss_sum

RULES = DEFAULT_LOGICAL_AXIS_RULES


def _problem(layout, batch=4, length=37, d=16, vocab=50, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, length, d)), jnp.float32)
    shape = (vocab, d) if layout == "VD" else (d, vocab)
    w = jnp.asarray(rng.normal(size=shape) / np.sqrt(d), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
    mask = jnp.asarray(rng.random((batch, length)) > 0.25, jnp.float32)
    return x, w, targets, mask


def log_softmax_loss(x, w, targets, mask, layout):
    """What the step computed before the fusion: log-probabilities over the whole logits."""
    log_probs = jax.nn.log_softmax(jnp.einsum(f"BTD,{layout}->BTV", x, w), axis=-1)
    return -jnp.sum(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0] * mask)


# Its loss and gradients by (x, w), compiled once per shape and layout (not one program per
# operation, as jax.value_and_grad alone would run them).
reference = jax.jit(jax.value_and_grad(log_softmax_loss, argnums=(0, 1)), static_argnums=4)


@pytest.mark.parametrize("layout", ["DV", "VD"])
@pytest.mark.parametrize("chunk_rows", [4 * 37, 4 * 10, 4])  # 1 chunk; 4 chunks (3 padded); 37
def test_fused_loss_and_gradients_equal_log_softmax(layout, chunk_rows):
    x, w, targets, mask = _problem(layout)
    expected, expected_grads = reference(x, w, targets, mask, layout)

    def fused(x, w):
        return output_cross_entropy(x, w, layout, targets, mask, rules=RULES, chunk_rows=chunk_rows)

    loss, grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(x, w)
    # fp32 throughout: only the order of the sums differs.
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(fused)(x, w), expected, rtol=1e-6)  # the eval path
    for ours, theirs in zip(grads, expected_grads, strict=True):
        assert ours.dtype == jnp.float32
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def test_padding_targets_get_no_gradient():
    x, w, targets, mask = _problem("DV")
    mask = mask.at[:, 20:].set(0.0)
    grads = jax.jit(  # one program, not one per operation
        jax.grad(
            lambda x: output_cross_entropy(x, w, "DV", targets, mask, rules=RULES, chunk_rows=8)
        )
    )(x)
    np.testing.assert_array_equal(grads[:, 20:], 0.0)


def test_bf16_compute():
    x, w, targets, mask = _problem("VD")
    expected, expected_grads = reference(x, w, targets, mask, "VD")
    x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    loss, grads = jax.jit(  # one program, not one per operation
        jax.value_and_grad(
            lambda x, w: output_cross_entropy(
                x, w, "VD", targets, mask, rules=RULES, chunk_rows=40
            ),
            argnums=(0, 1),
        )
    )(x16, w16)
    assert loss.dtype == jnp.float32
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]
    np.testing.assert_allclose(loss, expected, rtol=1e-2)
    for ours, theirs in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(ours.astype(jnp.float32), theirs, rtol=0, atol=5e-2)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.slow
def test_the_models_loss_is_the_log_softmax_of_its_logits(tie):
    # One layer: the loss under test sits after the blocks, whatever their number.
    cfg = dataclasses.replace(compose_config().model, tie_embeddings=tie, num_layers=1)
    spec = parse_mesh_shape([[1, 1], ["fsdp", "tp"]], 1)
    model = abstract_model(cfg, build_mesh(spec, jax.devices()[:1]), spec)
    # Compiled (as is `before` below): one program each, not one per operation.
    params = jax.jit(
        lambda: nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    )()
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 300, (2, 33)), jnp.int32)
    tokens = tokens.at[1, 25:].set(0)  # padding (pad id 0) at the end of the second row

    def loss(params):
        total, count, _ = token_loss_sum(  # no routing statistics: a dense model
            model, params, tokens, token_format=TokenFormat(pad_id=0), compute_dtype=jnp.float32
        )
        return total, count

    (total, count), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    def before(params):  # the loss as the step computed it from the model's logits
        logits = Transformer(cfg, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(logits)
        nnx.replace_by_pure_dict(state, params)
        logits = nnx.merge(graphdef, state)(tokens[:, :-1])
        mask = (tokens[:, 1:] != 0).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(picked * mask)

    expected, expected_grads = jax.jit(jax.value_and_grad(before))(params)
    assert float(count) == 2 * 32 - 8
    np.testing.assert_allclose(total, expected, rtol=1e-6)
    # Gradients of a sum over 56 tokens (entries up to ~5): reordered fp32 sums, and the
    # projections' weight gradients as one 2-D matmul each (meshtrain.models.layers.project),
    # move entries by up to ~1e-6 absolute.
    for ours, theirs in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=4e-6)


def _sharded_grads(
    layout, chunk_rows, *, batch=8, length=32, vocab=64, mesh_shape=((4, 2), ("fsdp", "tp"))
):
    """Loss and gradients on a [4, 2] fsdp × tp mesh (or `mesh_shape`), the fsdp bytes of the
    compiled program's collectives, and its text."""
    spec = parse_mesh_shape([list(mesh_shape[0]), list(mesh_shape[1])], 8)
    mesh = build_mesh(spec, jax.devices()[:8])
    x, w, targets, mask = _problem(layout, batch=batch, length=length, d=16, vocab=vocab)
    w_spec = P("tp", "fsdp") if layout == "VD" else P("fsdp", "tp")
    rows = ("dp", "fsdp", "ep")  # the batch's axes
    with jax.set_mesh(mesh):
        x, targets, mask = (
            jax.device_put(a, NamedSharding(mesh, P(rows, *[None] * (a.ndim - 1))))
            for a in (x, targets, mask)
        )
        w = jax.device_put(w, NamedSharding(mesh, w_spec))
        step = jax.jit(
            jax.value_and_grad(
                lambda x, w: output_cross_entropy(
                    x, w, layout, targets, mask, rules=RULES, chunk_rows=chunk_rows
                ),
                argnums=(0, 1),
            )
        )
        compiled = step.lower(x, w).compile()
        loss, grads = compiled(x, w)
    fsdp_bytes = sum(
        c.ring_bytes_per_step
        for c in account_collectives(compiled.as_text(), mesh).collectives
        if "fsdp" in c.mesh_axes
    )
    return float(loss), jax.device_get(grads), fsdp_bytes, compiled.as_text()


@pytest.mark.parametrize("layout", ["DV", "VD"])
def test_sharded_and_chunked_gradients_reduce_once_over_the_batch(layout):
    x, w, targets, mask = _problem(layout, batch=8, length=32, d=16, vocab=64)
    expected, expected_grads = reference(x, w, targets, mask, layout)
    whole_loss, whole_grads, whole_bytes, _ = _sharded_grads(layout, chunk_rows=2 * 32)  # 1 chunk
    loss, grads, chunked_bytes, _ = _sharded_grads(layout, chunk_rows=2 * 8)  # 4 chunks
    for value, gradients in ((whole_loss, whole_grads), (loss, grads)):
        np.testing.assert_allclose(value, expected, rtol=1e-6)
        for ours, theirs in zip(gradients, expected_grads, strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    # Each chunk adds its dW to a per-batch-shard sum: the chunks move no more bytes over fsdp
    # than the one-chunk program (a few bytes of loss sums aside).
    assert chunked_bytes == pytest.approx(whole_bytes, abs=64)


@pytest.mark.parametrize("layout", ["DV", "VD"])
def test_a_vocabulary_larger_than_the_batch_moves_tokens_not_the_weight(layout):
    """8 × 4 = 32 tokens against 512 vocabulary rows: the loss gathers the tokens and splits
    the vocabulary over fsdp × tp instead of gathering the weight over fsdp and reducing its
    gradient. The same loss and gradients, in fewer bytes over fsdp."""
    shape = {"batch": 8, "length": 4, "vocab": 512}
    x, w, targets, mask = _problem(layout, **shape, d=16)
    expected, expected_grads = reference(x, w, targets, mask, layout)
    loss, grads, fsdp_bytes, _ = _sharded_grads(layout, chunk_rows=64, **shape)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    for ours, theirs in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    # Gathering the weight [512, 16] / tp over fsdp and all-reducing its gradient would move
    # 3/4 · 16 KiB + 2 · 3/4 · 16 KiB = 36 KiB per device; the tokens [32, 16] are 2 KiB.
    weight_bytes = 512 * 16 * 4 / 2
    assert fsdp_bytes < 0.5 * (3 / 4 * weight_bytes * 3)


@pytest.mark.parametrize("layout", ["DV", "VD"])
def test_with_ep_the_vocabulary_splits_over_every_batch_axis(layout):
    """On [[2,4],[ep,fsdp]] the output weight is whole along ep and the tokens are split over
    fsdp and ep: each device computes the logits of every token for 512 / 8 = 64 vocabulary
    rows (not 512 / 4, each pair of ep devices computing the same ones), with the same loss and
    gradients (the weight gradient gathered over ep, then resharded as without ep)."""
    shape = {"batch": 8, "length": 4, "vocab": 512}
    x, w, targets, mask = _problem(layout, **shape, d=16)
    expected, expected_grads = reference(x, w, targets, mask, layout)
    loss, grads, _, text = _sharded_grads(
        layout, chunk_rows=64, mesh_shape=((2, 4), ("ep", "fsdp")), **shape
    )
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    for ours, theirs in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    # the logits' products: [32 tokens, vocabulary rows per device]
    widths = set(re.findall(r"= f32\[32,(\d+)\]\{[^}]*\} dot\(", text))
    assert "64" in widths and "128" not in widths, widths
