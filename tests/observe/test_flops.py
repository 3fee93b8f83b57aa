"""The FLOP formula against a hand count, the 6N rule, sliding windows and XLA's own count."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers.config import compose_config

from meshtrain.models.transformer import Transformer
from meshtrain.observe.flops import (
    attended_keys,
    attention_windows,
    forward_flops,
    train_flops_per_step,
)

# D=8, 2 layers, N=4 query heads, K=2 key/value heads, H=2, F=16, V=32; sequences of T=4.
SMALL = dict(
    d_model=8, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2, mlp_dim=16, vocab_size=32
)


def small_config(**changes):
    return dataclasses.replace(compose_config().model, **{**SMALL, **changes})


def test_hand_count_of_a_small_model():
    count = forward_flops(small_config(), seq_len=4)
    # Per token and layer: q 2·D·N·H = 128, k 2·D·K·H = 64, v 64, o 128 → 384; × 4 tokens × 2 layers.
    assert count.projections == 384 * 4 * 2 == 3072
    # Causal: the 4 queries see 1+2+3+4 = 10 keys; per (query, key): 2·H for q·k plus 2·H for
    # p·v, per query head: 4·2·4 = 32; × 10 × 2 layers.
    assert count.attention == 32 * 10 * 2 == 640
    # gate, up and down: 3 × 2·D·F = 768 per token; × 4 tokens × 2 layers.
    assert count.mlp == 768 * 4 * 2 == 6144
    # The output projection 2·D·V per token; the embedding lookup is a gather.
    assert count.logits == 2 * 8 * 32 * 4 == 2048
    assert count.embedding == 0
    assert count.forward == 11904
    assert count.train == 3 * 11904 == 35712
    assert train_flops_per_step(small_config(), seq_len=4, sequences=5) == 5 * 35712


def test_lora_counts_its_adapters_and_no_gradient_for_the_frozen_weights():
    from meshtrain.config.lora import LoraConfig

    cfg = small_config(lora=LoraConfig(rank=2, targets=["q", "down"]))
    count = forward_flops(cfg, seq_len=4)
    # Per token and layer: q's adapter 2·r·(D + N·H) = 64, down's 2·r·(F + D) = 96.
    assert count.adapters == (64 + 96) * 4 * 2 == 1280
    assert count.forward == 11904 + 1280
    # The weights: forward and the activations' gradient; attention and adapters 3×.
    assert count.train == 2 * (3072 + 6144 + 2048) + 3 * (640 + 1280) == 28288


def test_reduces_to_six_n_plus_attention():
    """Kaplan's 6·N per token, N the matmul parameters (the output projection included, the
    embedding lookup not), plus 3× the causal attention term."""
    cfg = small_config(tie_embeddings=False)
    params = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    matmul_params = sum(
        p.size for path, p in nnx.to_flat_state(params) if p.ndim >= 2 and path[0] != "embed"
    )
    assert matmul_params == 2 * (64 + 32 + 32 + 64 + 3 * 128) + 8 * 32 == 1408
    count = forward_flops(cfg, seq_len=4)
    assert count.train == 6 * matmul_params * 4 + 3 * count.attention
    # Tied or untied, the output projection is the same matmul.
    assert forward_flops(small_config(tie_embeddings=True), seq_len=4) == count


@pytest.mark.parametrize(
    ("seq_len", "window", "expected"),
    [
        (4, None, 10),  # 1 + 2 + 3 + 4
        (4, 2, 7),  # 1 + 2 + 2 + 2
        (4, 4, 10),  # a window as long as the sequence is full attention
        (4, 9, 10),
        (6, 1, 6),  # each token sees only itself
        (4096, 1024, 1024 * 1025 // 2 + 3072 * 1024),
    ],
)
def test_attended_keys(seq_len, window, expected):
    assert attended_keys(seq_len, window) == expected
    assert attended_keys(seq_len, window) == sum(
        min(t + 1, window or seq_len) for t in range(seq_len)
    )


def test_sliding_window_layers_count_their_window():
    cfg = small_config()
    assert attention_windows(cfg) == [None, None]
    full = forward_flops(cfg, seq_len=4)
    mixed = forward_flops(cfg, seq_len=4, windows=[None, 2])
    # Layer 2 sees 7 keys instead of 10: 32 FLOPs per (query, key) pair less 3 times.
    assert full.attention - mixed.attention == 32 * 3
    assert mixed.mlp == full.mlp and mixed.projections == full.projections
    with pytest.raises(ValueError, match="3 attention windows for 2 layers"):
        forward_flops(cfg, seq_len=4, windows=[None, None, None])
    # The model's own pattern gives the same count: layer 2 is a local layer of window 2.
    local = small_config(attention_pattern=["global", "local"], sliding_window=2)
    assert attention_windows(local) == [None, 2]
    assert forward_flops(local, seq_len=4) == mixed


def test_gemma3_windows_follow_the_five_local_one_global_pattern():
    cfg = compose_config("model=gemma3_1b").model
    windows = attention_windows(cfg)
    assert len(windows) == 26 and windows[:6] == [512] * 5 + [None]
    assert windows.count(None) == 4  # layers 6, 12, 18 and 24
    # At 4096 tokens a local layer attends to 512·513/2 + 3584·512 keys, a global layer to
    # 4096·4097/2: the attention FLOPs are 22 local + 4 global layers of those.
    per_key = 4 * cfg.head_dim * cfg.num_heads
    expected = per_key * (22 * (512 * 513 // 2 + 3584 * 512) + 4 * (4096 * 4097 // 2))
    assert forward_flops(cfg, seq_len=4096).attention == expected


def test_matmuls_match_what_xla_counts_for_the_model():
    """XLA's cost analysis of the real forward pass counts the same matmuls, except that the
    attention kernel computes the whole T×T square and masks it (twice the causal half, plus
    the diagonal), and XLA also counts elementwise work (norms, softmax, rotary): a few %."""
    # The xla kernel: the chunked one (model.attention=auto on CPU) skips the keys after each
    # block of queries.
    cfg = compose_config("model.attention=xla").model
    seq_len, batch = 128, 2
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    tokens = jnp.zeros((batch, seq_len), jnp.int32)
    xla = forward.lower(state, tokens).compile().cost_analysis()["flops"]
    count = forward_flops(cfg, seq_len)
    square = count.attention * seq_len / ((seq_len + 1) / 2)  # every key for every query
    matmuls = batch * (count.forward - count.attention + square)
    assert matmuls <= xla <= 1.05 * matmuls, (xla, matmuls)
