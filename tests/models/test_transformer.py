"""The transformer: causality, rotary embeddings, grouped-query attention, tied output, sliding
windows, and the memory levers (remat, scan over layers) computing what the plain model does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_hf
from helpers.runs import train_tiny
from jax.sharding import PartitionSpec

from meshtrain.config import ModelConfig
from meshtrain.models.layers import RMSNorm, RopeSpec, apply_rope, rope_angles
from meshtrain.models.transformer import Transformer
from meshtrain.weights.load import load_hf

CFG = ModelConfig()


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def test_logits_shape_and_causality(model):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 32)), jnp.int32)
    logits = model(tokens)
    assert logits.shape == (2, 32, CFG.vocab_size)
    changed = tokens.at[:, 20:].set(7)
    # Positions before the change see only unchanged tokens.
    np.testing.assert_allclose(model(changed)[:, :20], logits[:, :20], rtol=1e-5, atol=1e-6)
    assert not np.allclose(model(changed)[:, 20:], logits[:, 20:])


def rotary_embedding(x, positions, theta):
    return apply_rope(x, *rope_angles(positions, RopeSpec(theta).inv_freq(x.shape[-1])))


def test_rotary_embedding_depends_only_on_relative_position():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

    def score(pos_q, pos_k):
        rq = rotary_embedding(q, jnp.array([[pos_q]]), 10000.0)
        rk = rotary_embedding(k, jnp.array([[pos_k]]), 10000.0)
        return float(jnp.sum(rq * rk))

    assert score(5, 3) == pytest.approx(score(105, 103), rel=1e-4)
    assert score(0, 0) == pytest.approx(float(jnp.sum(q * k)), rel=1e-6)  # position 0: no rotation
    assert score(5, 3) != pytest.approx(score(5, 0), rel=1e-3)


def test_rmsnorm_normalises_to_unit_rms():
    x = jnp.asarray(np.random.default_rng(1).normal(3.0, 5.0, size=(4, 64)), jnp.float32)
    y = RMSNorm(64, eps=1e-6)(x)
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(y * y, axis=-1)), 1.0, rtol=1e-4)


def test_grouped_query_attention_shapes(model):
    attn = model.blocks[0].attn
    assert attn.q.shape == (CFG.d_model, CFG.num_heads, CFG.head_dim)
    assert attn.k.shape == (CFG.d_model, CFG.num_kv_heads, CFG.head_dim)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """Each key/value head k serves query heads k*G ... k*G + G - 1."""
    gqa_cfg = dataclasses.replace(CFG, num_layers=1)
    mha_cfg = dataclasses.replace(gqa_cfg, num_kv_heads=CFG.num_heads)
    gqa = Transformer(gqa_cfg, rngs=nnx.Rngs(0))
    mha = Transformer(mha_cfg, rngs=nnx.Rngs(1))
    groups = CFG.num_heads // CFG.num_kv_heads
    _, gqa_state = nnx.split(gqa)
    graph, mha_state = nnx.split(mha)
    pure = nnx.to_pure_dict(gqa_state)
    for name in ("k", "v"):
        pure["blocks"][0]["attn"][name] = jnp.repeat(
            pure["blocks"][0]["attn"][name], groups, axis=1
        )
    nnx.replace_by_pure_dict(mha_state, pure)
    mha = nnx.merge(graph, mha_state)
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
    np.testing.assert_allclose(mha(tokens), gqa(tokens), rtol=1e-5, atol=1e-6)


def test_tied_and_untied_output():
    tied = Transformer(CFG, rngs=nnx.Rngs(0))
    untied = Transformer(dataclasses.replace(CFG, tie_embeddings=False), rngs=nnx.Rngs(0))
    assert tied.lm_head is None
    assert untied.lm_head.shape == (CFG.d_model, CFG.vocab_size)
    count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    assert count(untied) - count(tied) == CFG.d_model * CFG.vocab_size


# The Gemma 3 features on a small model: local and global layers, sandwich norms, QK-norm,
# (1 + w) norm scales, embedding scaling, GeGLU, linear RoPE scaling, a non-default attention scale.
GEMMA_LIKE = dataclasses.replace(
    CFG,
    family="gemma3",
    num_layers=3,
    attention_pattern=["local", "local", "global"],
    sliding_window=8,
    rope_theta=1e6,
    rope_local_theta=1e4,
    rope_scaling="linear",
    rope_scaling_factor=8.0,
    qk_norm=True,
    post_norms=True,
    norm_scale_offset=1.0,
    scale_embeddings=True,
    mlp_activation="gelu",
    query_pre_attn_scalar=24.0,
)


def test_a_local_layer_sees_only_its_window():
    # Two local layers with a 4-token window: position t depends on tokens t-6 ... t only.
    cfg = dataclasses.replace(CFG, num_layers=2, attention_pattern=["local"], sliding_window=4)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.arange(16, dtype=jnp.int32)[None, :]
    change = jnp.abs(model(tokens.at[0, 0].set(200)) - model(tokens)).max(axis=-1)[0]  # [16]
    assert (change[:7] > 1e-4).all()
    # Masked keys get probability exactly 0, so the later positions are bit-identical.
    np.testing.assert_array_equal(change[7:], 0.0)


def _loss_and_grads(cfg, tokens):
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

    def loss(params):
        log_probs = jax.nn.log_softmax(nnx.merge(graphdef, params)(tokens[:, :-1]))
        return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    grads = nnx.to_pure_dict(grads)
    if cfg.scan_layers:  # unstack [layers, ...] into one entry per block, as without scan
        stacked = grads["blocks"]
        grads["blocks"] = {
            i: jax.tree.map(lambda g, i=i: g[i], stacked) for i in range(cfg.num_layers)
        }
    return float(value), grads


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 384, (2, 25)), jnp.int32)


@pytest.fixture(scope="module")
def plain_loss_and_grads():
    return _loss_and_grads(GEMMA_LIKE, TOKENS)


@pytest.mark.parametrize(
    ("remat", "scan_layers"),
    [("full", False), ("minimal", False), ("none", True), ("dots_saveable", True)],
)
@pytest.mark.slow
def test_remat_and_scan_give_the_plain_models_loss_and_gradients(
    remat, scan_layers, plain_loss_and_grads
):
    loss, grads = plain_loss_and_grads
    variant = dataclasses.replace(GEMMA_LIKE, remat=remat, scan_layers=scan_layers)
    variant_loss, variant_grads = _loss_and_grads(variant, TOKENS)
    # The same initial parameters (scan stacks the very values of the plain blocks) and the same
    # arithmetic: remat recomputes the forward pass, and scan changes how XLA fuses and orders
    # the operations, which reorders some fp32 sums. Measured: the loss differs by <1e-7
    # relative, single gradient entries of size ~3e-2 by up to 1.5e-7.
    np.testing.assert_allclose(variant_loss, loss, rtol=1e-6)
    for ours, plain in zip(jax.tree.leaves(variant_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(ours, plain, rtol=0, atol=1e-6)


def test_scan_stacks_parameters_on_a_replicated_layers_axis():
    model = Transformer(dataclasses.replace(GEMMA_LIKE, scan_layers=True), rngs=nnx.Rngs(0))
    q = model.blocks.attn.q
    assert q.shape == (3, CFG.d_model, CFG.num_heads, CFG.head_dim)
    assert q.get_metadata()["logical_axes"] == ("layers", "embed", "heads", "head_dim")
    plain = Transformer(GEMMA_LIKE, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(q[...][2], plain.blocks[2].attn.q[...])


@pytest.mark.slow  # about 10 s on 2 cores
def test_scan_and_remat_train_like_the_plain_model_on_a_sharded_mesh(tmp_path):
    common = (
        "model.mesh_shape=[[4,2],[fsdp,tp]]",
        "data=synthetic",
        "training.micro_batch_size=1",
        "training.steps=3",
        "training.warmup_steps=1",
        "training.log_every=1",
        "training.eval_every=0",
    )
    plain = train_tiny(tmp_path / "plain", *common)
    levers = train_tiny(
        tmp_path / "levers", *common, "model.scan_layers=true", "model.remat=minimal"
    )
    # As across meshes (tests/train/test_loop.py): reordered fp32 sums, three Adam steps.
    np.testing.assert_allclose(
        [h["loss"] for h in levers.history], [h["loss"] for h in plain.history], rtol=1e-5
    )
    q = levers.state.params["blocks"]["attn"]["q"]  # [layers, D, N, H], layers replicated
    assert q.shape == (2, CFG.d_model, CFG.num_heads, CFG.head_dim)
    # layers: pp, of size 1 on this mesh, so written as None (parallel.rules.named_shardings)
    assert q.sharding.spec == PartitionSpec(None, "fsdp", "tp", None)
    # The stacked norm scales ([layers, D]) are spared weight decay like the plain model's.
    np.testing.assert_allclose(
        levers.state.params["blocks"]["mlp_norm"]["scale"][1],
        plain.state.params["blocks"][1]["mlp_norm"]["scale"],
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.slow
def test_a_call_on_sharded_parameters_inside_the_callers_own_grad(tmp_path):
    """A model merged inside the caller's `jax.grad` (as a hand-written reference differentiates
    some of its weights) with concrete tokens: the call cannot set the parameters' mesh there
    (JAX refuses `jax.set_mesh` under any trace) and runs under the caller's, with the logits of
    a call outside and the gradient of `jax.jit` around the same function."""
    directory = tiny_hf.write_checkpoint("llama", tmp_path / "llama")
    model = load_hf(directory, [[4, 2], ["fsdp", "tp"]])
    tokens = jnp.asarray(np.arange(16, dtype=np.int32)[None] % 97)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)

    def total(scale):
        merged = jax.tree.map(lambda leaf: leaf, state)
        nnx.replace_by_pure_dict(merged, {**params, "final_norm": {"scale": scale}})
        logits = nnx.merge(graphdef, merged)(tokens)
        return jnp.sum(logits * jnp.cos(logits)), logits

    scale = params["final_norm"]["scale"]
    grad, logits = jax.grad(total, has_aux=True)(scale)
    np.testing.assert_allclose(logits, model(tokens), rtol=1e-6, atol=1e-6)
    jitted, _ = jax.jit(jax.grad(total, has_aux=True))(scale)
    assert float(jnp.abs(grad).max()) > 0.1
    np.testing.assert_allclose(grad, jitted, rtol=1e-5, atol=1e-5)
