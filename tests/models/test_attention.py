"""Attention: every kernel that runs on CPU (xla, chunked) computes what the former 5-D einsum
did, outputs and gradients, on causal, windowed and multi-document masks with grouped-query
heads down to a single key/value head; model.attention is chosen, logged and refused as
documented."""

import dataclasses
import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.config import compose_config

from meshtrain.config import ModelConfig
from meshtrain.config.validate import check_config
from meshtrain.errors import ConfigError
from meshtrain.hardware.target import TargetDevice, cudnn_version, target_device
from meshtrain.models import attention as attention_module
from meshtrain.models.attention import WindowOfKind, dot_product_attention
from meshtrain.models.attention_choice import (
    cudnn_head_dim_limit,
    cudnn_unsupported,
    select_attention,
)
from meshtrain.models.transformer import Transformer
from meshtrain.observe.hlo import parse_module
from meshtrain.train.documents import TokenFormat


def einsum_attention(q, k, v, *, scale, window=None, segment_ids=None):
    """The oracle: the model's attention before the kernels (a 5-D einsum over [B, K, G, T, S]
    with an fp32 mask and softmax), with segment masking added."""
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    t, s = jnp.arange(length)[:, None], jnp.arange(length)[None, :]
    mask = s <= t
    if window is not None:
        mask = mask & (s > t - window)
    mask = mask[None]  # [1, T, S]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k).astype(jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(batch, length, heads, head_dim)


def _inputs(heads, kv_heads, length=24, batch=2, head_dim=8, seed=0):
    rng = np.random.default_rng(seed)
    shape = lambda h: (batch, length, h, head_dim)  # noqa: E731
    q, k, v = (
        jnp.asarray(rng.normal(size=shape(h)), jnp.float32) for h in (heads, kv_heads, kv_heads)
    )
    return q, k, v


# Three documents in the first row (lengths 7, 12, 5), one in the second.
SEGMENTS = jnp.asarray([[0] * 7 + [1] * 12 + [2] * 5, [3] * 24], jnp.int32)
# chunked with blocks of 5 (uneven: 4 blocks of 5 and one of 4) and of 8 queries, unrolled as on
# CPU, and with blocks of 5 looped as compiled for a GPU (4 loops of uneven groups for full
# causal attention, 1 for a window); a block of at least the sequence is the xla kernel itself.
KERNELS = [
    ("xla", None, "cpu"),
    pytest.param("chunked", 5, "cpu", marks=pytest.mark.slow),
    ("chunked", 8, "cpu"),
    pytest.param("chunked", 5, "gpu", marks=pytest.mark.slow),  # a GPU-target compile: 23 s
]
A100 = TargetDevice("gpu", "NVIDIA A100-SXM4-80GB", (8, 0))
MASKS = {
    "causal": (None, False),
    "window": (5, False),
    "documents": (None, True),
    "both": (5, True),
}


def _output_and_grads(fn, q, k, v, cotangent):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(cotangent)


# Every (heads, mask) case of a kernel: grouped-query heads down to a single key/value head, on
# each mask. One compiled program computes a kernel's outputs and gradients on all of them (and
# one the oracle's): each case is its own part of that program, as it was its own program.
HEADS = [(4, 4), (4, 2), (6, 1)]
CASES = [(heads, kv_heads, mask) for heads, kv_heads in HEADS for mask in MASKS]


def _all_cases(attention):
    """[(output, (dq, dk, dv))] of attention(q, k, v, *, window, segment_ids) on each of CASES,
    under one jit: the inputs of _inputs(heads, kv_heads) and a random cotangent, so that every
    output entry weighs on the gradients."""
    inputs = {}
    for heads, kv_heads in HEADS:
        q, k, v = _inputs(heads, kv_heads)
        cotangent = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
        inputs[f"{heads}-{kv_heads}"] = (q, k, v, cotangent)

    def run(inputs):
        results = []
        for heads, kv_heads, mask in CASES:
            window, segments = MASKS[mask]
            segment_ids = SEGMENTS if segments else None
            fn = partial(attention, window=window, segment_ids=segment_ids)
            results.append(_output_and_grads(fn, *inputs[f"{heads}-{kv_heads}"]))
        return results

    return jax.jit(run)(inputs)


@pytest.fixture(scope="module")
def oracle_cases():
    return _all_cases(partial(einsum_attention, scale=0.3))


@pytest.mark.parametrize(("kernel", "block", "platform"), KERNELS)
def test_kernels_match_the_einsum_oracle(kernel, block, platform, oracle_cases, monkeypatch):
    """Each kernel against the oracle on every case of CASES (heads × masks), outputs and
    gradients; every case that differs is reported."""
    if platform == "gpu":  # the program a GPU host compiles, run here
        monkeypatch.setattr(attention_module, "target_device", lambda device=None: A100)

    def ours(q, k, v, *, window, segment_ids):
        return dot_product_attention(
            q, k, v, kernel=kernel, block=block, scale=0.3, window=window, segment_ids=segment_ids
        )

    failures = []
    for case, (got, got_grads), (expected, expected_grads) in zip(
        CASES, _all_cases(ours), oracle_cases, strict=True
    ):
        try:
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=str(case))
            for name, ours_grad, oracle_grad in zip("qkv", got_grads, expected_grads, strict=True):
                np.testing.assert_allclose(
                    ours_grad, oracle_grad, rtol=1e-5, atol=1e-5, err_msg=f"{case} d{name}"
                )
        except AssertionError as failure:
            failures.append(str(failure))
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(
    not target_device().nvidia_gpu, reason="cuDNN's flash attention needs an NVIDIA GPU"
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("head_dim", [64, 256])
def test_cudnn_matches_the_einsum_oracle_in_bf16(heads, kv_heads, mask, head_dim):
    """The GPU kernel against the same oracle, in bf16 (cuDNN runs no fp32): outputs and
    gradients within bf16's rounding of the fp32 oracle's, at Llama's head_dim 64 and Gemma 3's
    256 (where this GPU's cuDNN takes it). Runs only where a GPU is present."""
    if cudnn_head_dim_limit(target_device(), cudnn_version()) < head_dim:
        pytest.skip(f"cuDNN here takes head_dim <= 128, not {head_dim}")
    window, segments = MASKS[mask]
    length = 128  # cuDNN's shapes: head_dim a multiple of 8, a sequence of whole tiles
    q, k, v = _inputs(heads, kv_heads, length=length, head_dim=head_dim)
    segment_ids = None
    if segments:
        segment_ids = jnp.asarray([[0] * 40 + [1] * 70 + [2] * 18, [3] * length], jnp.int32)
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def oracle(q, k, v):
        return einsum_attention(q, k, v, scale=0.125, window=window, segment_ids=segment_ids)

    def ours(q, k, v):
        q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
        out = dot_product_attention(
            q, k, v, kernel="cudnn", scale=0.125, window=window, segment_ids=segment_ids
        )
        return out.astype(jnp.float32)

    expected, expected_grads = _output_and_grads(oracle, q, k, v, cotangent)
    got, got_grads = jax.jit(lambda *a: _output_and_grads(ours, *a))(q, k, v, cotangent)
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)
    for name, ours_grad, oracle_grad in zip("qkv", got_grads, expected_grads, strict=True):
        np.testing.assert_allclose(ours_grad, oracle_grad, rtol=5e-2, atol=5e-2, err_msg=name)


def test_documents_do_not_see_each_other():
    q, k, v = _inputs(4, 2)
    attend = jax.jit(
        lambda q, k, v: dot_product_attention(
            q, k, v, kernel="chunked", block=8, segment_ids=SEGMENTS
        )
    )
    out = attend(q, k, v)
    # Changing the first document's keys and values leaves the other documents' outputs as
    # they were, to the bit (their probabilities on it are exactly 0).
    k2, v2 = k.at[0, :7].add(1.0), v.at[0, :7].add(1.0)
    changed = attend(q, k2, v2)
    np.testing.assert_array_equal(changed[0, 7:], out[0, 7:])
    assert not np.allclose(changed[0, :7], out[0, :7])


def test_auto_picks_chunked_xla_on_cpu_and_says_why():
    kernel, why = select_attention("auto", dtype=jnp.bfloat16, head_dim=64)
    assert kernel == "chunked"
    assert why == "auto: cuDNN needs an NVIDIA GPU, this is cpu"
    assert select_attention("xla", dtype=jnp.float32, head_dim=64) == ("xla", "model.attention=xla")


H100 = TargetDevice("gpu", "NVIDIA H100 80GB HBM3", (9, 0))
B200 = TargetDevice("gpu", "NVIDIA B200", (10, 0))


def test_cudnn_shape_rules():
    assert cudnn_unsupported(jnp.bfloat16, 64, A100, 92800) is None
    assert cudnn_unsupported(jnp.float16, 128, A100, 92800) is None
    assert "bf16/fp16" in cudnn_unsupported(jnp.float32, 64, H100, 92800)
    assert cudnn_unsupported(jnp.bfloat16, 60, H100, 92800) == (
        "cuDNN 9.28 on NVIDIA H100 80GB HBM3 needs head_dim <= 256 and a multiple of 8, got 60"
    )


def test_cudnn_takes_head_dim_256_on_hopper_and_blackwell_with_a_recent_cudnn():
    """Gemma 3's head_dim 256: cuDNN on Hopper from 9.13 and Blackwell from 9.23, never Ampere."""
    assert cudnn_unsupported(jnp.bfloat16, 256, H100, 91300) is None
    assert cudnn_unsupported(jnp.bfloat16, 256, B200, 92300) is None
    assert cudnn_unsupported(jnp.bfloat16, 256, A100, 92800) == (
        "cuDNN 9.28 on NVIDIA A100-SXM4-80GB needs head_dim <= 128 and a multiple of 8, got 256"
    )
    assert "head_dim <= 128" in cudnn_unsupported(jnp.bfloat16, 256, H100, 91200)
    assert "head_dim <= 128" in cudnn_unsupported(jnp.bfloat16, 256, B200, 92200)
    assert "cuDNN unknown" in cudnn_unsupported(jnp.bfloat16, 256, H100, None)
    assert cudnn_unsupported(jnp.bfloat16, 264, H100, 92800) is not None


def test_auto_follows_the_mesh_being_compiled_for_not_the_host():
    """Inside jax.set_mesh the kernel is chosen for the mesh's devices; outside, this host's."""
    assert target_device() == TargetDevice("cpu", jax.devices()[0].device_kind)
    assert target_device(jax.devices()[0]).platform == "cpu"
    assert not TargetDevice("gpu", "AMD Instinct MI300X").nvidia_gpu
    assert TargetDevice("gpu", "NVIDIA GeForce RTX 4090").nvidia_gpu


@pytest.mark.skipif(target_device().nvidia_gpu, reason="checks the error without a GPU")
def test_cudnn_on_cpu_is_a_config_error_at_start_up():
    from meshtrain.train.setup import prepare

    cfg = compose_config("data=synthetic", "model.attention=cudnn")
    with pytest.raises(ConfigError) as error:
        prepare(cfg, jax.devices()[:1], with_data=False)
    assert str(error.value) == "model.attention=cudnn needs an NVIDIA GPU; use auto or xla"


def test_unknown_attention_is_a_config_error():
    cfg = compose_config("model.attention=flash")
    with pytest.raises(
        ConfigError, match=r"model.attention='flash' is not supported; use one of: auto, xla, cudnn"
    ):
        check_config(cfg)


def test_the_step_logs_the_kernel_it_runs(caplog):
    from meshtrain.train.objectives import NextToken, StepInputs
    from meshtrain.train.optimizer import build_optimizer, learning_rate_schedule
    from meshtrain.train.setup import prepare
    from meshtrain.train.state import state_shardings
    from meshtrain.train.step import make_train_step

    cfg = compose_config("data=synthetic")
    setup = prepare(cfg, jax.devices()[:1], with_data=False)
    tx = build_optimizer(cfg.training)
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        make_train_step(
            setup.model,
            tx,
            learning_rate_schedule(cfg.training),
            state_shardings=state_shardings(setup.model, tx, setup.mesh),
            batch_sharding=None,
            objective=NextToken(StepInputs(TokenFormat(pad_id=0), jnp.float32)),
            training=cfg.training,
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention:")]
    assert lines == ["attention: chunked (auto: cuDNN needs an NVIDIA GPU, this is cpu)"]


CFG = dataclasses.replace(
    ModelConfig(), num_layers=2, attention_pattern=["local", "global"], sliding_window=6
)


def test_segment_ids_in_the_model():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 24)), jnp.int32)
    np.testing.assert_array_equal(model(tokens, segment_ids=jnp.zeros_like(tokens)), model(tokens))
    logits = model(tokens, segment_ids=SEGMENTS)
    changed = model(tokens.at[0, :7].set(5), segment_ids=SEGMENTS)
    np.testing.assert_array_equal(changed[0, 7:], logits[0, 7:])
    assert not np.allclose(changed[0, :7], logits[0, :7])


@pytest.mark.slow
def test_the_model_gives_the_same_logits_with_every_kernel(monkeypatch):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 40)), jnp.int32)
    xla = Transformer(dataclasses.replace(CFG, attention="xla"), rngs=nnx.Rngs(0))
    monkeypatch.setattr(attention_module, "MIN_CHUNK_QUERIES", 16)  # blocks of 16, 16 and 8
    auto = Transformer(CFG, rngs=nnx.Rngs(0))
    assert auto.attention_kernel(jnp.float32)[0] == "chunked"
    for segment_ids in (None, jnp.asarray([[0] * 13 + [1] * 27, [2] * 40], jnp.int32)):
        np.testing.assert_allclose(
            auto(tokens, segment_ids=segment_ids),
            xla(tokens, segment_ids=segment_ids),
            rtol=1e-5,
            atol=1e-5,
        )


TRACED_WINDOWS = (5, None)


@jax.jit
@partial(jax.value_and_grad, argnums=(0, 1, 2))
def _traced_kind(q, k, v, kind):
    """One program for every kind: the window is that of the traced kind."""
    window = WindowOfKind(kind, TRACED_WINDOWS)
    return dot_product_attention(q, k, v, kernel="chunked", window=window, block=4).sum()


@partial(jax.jit, static_argnames="window")
def _static_window(q, k, v, window):
    """The output and the gradients of its sum, for a static window."""
    out, vjp = jax.vjp(
        lambda q, k, v: dot_product_attention(q, k, v, kernel="chunked", window=window, block=4),
        q,
        k,
        v,
    )
    return out, vjp(jnp.ones_like(out))


@pytest.mark.parametrize("kind", [0, 1])
def test_a_traced_layer_kind_attends_with_its_own_window(kind):
    """WindowOfKind (a scanned layer of several kinds): only the attention branches on the
    kind, and each branch is the attention of that kind's window, outputs and gradients."""
    q, k, v = _inputs(4, 2, length=16, seed=3)
    value, grads = _traced_kind(q, k, v, jnp.int32(kind))
    out, expected_grads = _static_window(q, k, v, window=TRACED_WINDOWS[kind])
    expected = out.sum()  # summed on its own, as value_and_grad outside a jit sums it
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # about 16 s on 2 cores
def test_the_looped_chunked_kernel_does_not_grow_with_the_blocks(monkeypatch):
    """As compiled for a GPU, 16 or 64 blocks of queries are about the same program (4 loops
    for full causal attention, 1 for a window); unrolled on CPU, 64 blocks are 4× the code."""

    def instructions(blocks, window, platform):
        target = A100 if platform == "gpu" else TargetDevice("cpu", "cpu")
        monkeypatch.setattr(attention_module, "target_device", lambda device=None: target)
        q, k, v = _inputs(4, 2, length=16 * blocks)
        fn = jax.jit(
            jax.grad(
                lambda q: dot_product_attention(
                    q, k, v, kernel="chunked", window=window, block=16
                ).sum()
            )
        )
        module = parse_module(fn.lower(q).compile().as_text())
        return sum(len(c) for c in module.computations.values())

    for window in (None, 8):
        looped = instructions(16, window, "gpu"), instructions(64, window, "gpu")
        assert abs(looped[1] - looped[0]) < 0.05 * looped[0], looped
        unrolled = instructions(16, window, "cpu"), instructions(64, window, "cpu")
        assert unrolled[1] > 3 * unrolled[0], unrolled
