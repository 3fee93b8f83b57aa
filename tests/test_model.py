"""The transformer: causality, rotary embeddings, grouped-query attention, tied output."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtrain.config import ModelConfig
from meshtrain.models.layers import RMSNorm, rotary_embedding
from meshtrain.models.transformer import Transformer

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
