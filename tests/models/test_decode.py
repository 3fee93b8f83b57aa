"""The key/value cache path (models.decode): the logits of a padded prefill and of every decode
step equal those of the model's own call on the same prefix, for each family (Gemma past its
sliding window, with scan_layers too), also for a batch of left-padded prompts of different
lengths and for rows that share a prompt's cache (generation's layout); and on a [[4,2]] mesh the cache is sharded like the layers' keys and values (split over
tp, or replicated when tp exceeds the key/value heads)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_hf
from helpers.meshes import on_mesh
from jax.sharding import NamedSharding

import meshtrain
from meshtrain.config import ModelConfig
from meshtrain.models import decode
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.rules import logical_to_spec

CACHED_TOLERANCE = 1e-5  # relative to the largest logit; measured ~1e-6 (fp32 rounding)
PROMPT = 8  # tokens of the prefill, padded to BUCKET; the rest are decode steps
BUCKET = 16
_prefill = nnx.jit(decode.prefill, static_argnames="cache_length", graph=False)
_step = nnx.jit(decode.decode_step, graph=False)


def cached_logits(model: Transformer, tokens: np.ndarray, cache_length: int | None = None):
    """[T - PROMPT + 1, B, V]: the logits after tokens[:, :PROMPT] (a prefill of BUCKET
    positions, zeros after the prompt), then after each further token, one decode step each;
    and the cache the prefill made (of cache_length positions, BUCKET + T by default)."""
    batch, length = tokens.shape
    padded = np.zeros((batch, BUCKET), np.int32)  # [B, BUCKET]
    padded[:, :PROMPT] = tokens[:, :PROMPT]
    cache_length = BUCKET + length if cache_length is None else cache_length
    logits, prefilled = _prefill(model, padded, np.int32(PROMPT), cache_length=cache_length)
    rows, cache = [np.asarray(logits)], prefilled
    for position in range(PROMPT, length):
        logits, cache = _step(model, tokens[:, position : position + 1], np.int32(position), cache)
        rows.append(np.asarray(logits))
    return np.stack(rows), prefilled


def errors(cached: np.ndarray, full: np.ndarray) -> list[float]:
    """Relative error of each step's cached logits against the full call's [B, T, V]."""
    return [tiny_hf.relative_error(step, full[:, PROMPT - 1 + i]) for i, step in enumerate(cached)]


@pytest.mark.parametrize(
    ("family", "scan_layers"),
    [
        ("llama", False),
        pytest.param("qwen3", False, marks=pytest.mark.slow),
        pytest.param("gemma3", False, marks=pytest.mark.slow),
        ("gemma3", True),
    ],
)
def test_each_decode_step_equals_the_full_recompute(family, scan_layers, tmp_path):
    directory = tiny_hf.write_checkpoint(family, tmp_path / family)
    model = meshtrain.load_hf(directory, scan_layers=scan_layers)
    tokens = tiny_hf.TOKENS[:1].astype(np.int32)  # [1, 40]: past Gemma's 16-token window
    # A causal model's logits at position p are those of the prefix tokens[:, :p + 1].
    full = np.asarray(model(tokens))  # [1, 40, V]
    cached, _ = cached_logits(model, tokens)
    assert cached.shape == (tokens.shape[1] - PROMPT + 1, 1, tiny_hf.VOCAB)
    assert max(errors(cached, full)) <= CACHED_TOLERANCE


@pytest.mark.parametrize(("family", "scan_layers"), [("llama", False), ("gemma3", True)])
@pytest.mark.slow
def test_left_padded_prompts_of_different_lengths_each_get_their_own_logits(
    family, scan_layers, tmp_path
):
    """A batch as generation runs it: each prompt after its padding slots, every row's next
    token in the same slot; each row's logits are those of the model's call on that row's
    prefix alone (Gemma's rows run past its 16-token window)."""
    directory = tiny_hf.write_checkpoint(family, tmp_path / family)
    model = meshtrain.load_hf(directory, scan_layers=scan_layers)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, tiny_hf.VOCAB, (4, 40)).astype(np.int32)  # [B, T]
    lengths = np.array([3, 16, 8, 11], np.int32)  # each row's prompt, at most BUCKET
    steps = 24  # decode steps: the longest prompt's row reaches its 40th token
    pad = BUCKET - lengths  # [B]
    padded = np.zeros((4, BUCKET), np.int32)
    for row, length in enumerate(lengths):
        padded[row, pad[row] :] = tokens[row, :length]
    logits, cache = _prefill(model, padded, np.int32(BUCKET), BUCKET + steps, pad)
    rows = [np.asarray(logits)]  # [B, V] each
    for i in range(steps - 1):
        step_tokens = tokens[np.arange(4), lengths + i][:, None]  # [B, 1]
        logits, cache = _step(model, step_tokens, np.int32(BUCKET + i), cache, pad)
        rows.append(np.asarray(logits))
    for row, length in enumerate(lengths):
        full = np.asarray(model(tokens[row : row + 1, : length + steps - 1]))[0]  # [T, V]
        errs = [tiny_hf.relative_error(r[row], full[length - 1 + i]) for i, r in enumerate(rows)]
        assert max(errs) <= CACHED_TOLERANCE, (row, errs)


CFG = ModelConfig(num_heads=4, head_dim=32, init_std=0.2)  # the tiny model, 4 query heads
MESH = [[4, 2], ["fsdp", "tp"]]


@pytest.mark.parametrize("kv_heads", [pytest.param(2, marks=pytest.mark.slow), 1])
def test_on_a_mesh_the_cache_is_sharded_like_the_keys_and_values(kv_heads):
    cfg = dataclasses.replace(CFG, num_kv_heads=kv_heads)
    alone = Transformer(cfg, rngs=nnx.Rngs(0))
    sharded = on_mesh(alone, cfg, MESH)
    tokens = np.random.default_rng(0).integers(0, 259, (4, 24)).astype(np.int32)  # [B=4, T]
    mesh = sharded.params_mesh()
    with jax.set_mesh(mesh):  # the prefill's cache holds 32 positions, the 24 tokens' and more
        cached, cache = cached_logits(sharded, tokens, cache_length=32)
    assert max(errors(cached, np.asarray(alone(tokens)))) <= CACHED_TOLERANCE
    rules = sharded.rules  # kv_heads replicated when 2 tp ranks share 1 key/value head
    assert (rules["kv_heads"] is None) == (kv_heads == 1)
    # Per device and layer, the batch over fsdp=4; K over tp=2 when it divides: keys
    # [B, K, S, H], values [B, K, H, S].
    shapes = {
        decode.KEY_AXES: (1, 1, 32, cfg.head_dim),
        decode.VALUE_AXES: (1, 1, cfg.head_dim, 32),
    }
    for layers, axes in ((cache.keys, decode.KEY_AXES), (cache.values, decode.VALUE_AXES)):
        assert len(layers) == cfg.num_layers
        want = NamedSharding(mesh, logical_to_spec(axes[1:], rules))
        for array in layers:
            assert array.sharding.is_equivalent_to(want, 4)
            assert {s.data.shape for s in array.addressable_shards} == {shapes[axes]}


@pytest.mark.parametrize(("family", "scan_layers"), [("llama", False), ("gemma3", True)])
def test_rows_that_share_a_prompt_read_its_cache_once_and_get_their_own_logits(
    family, scan_layers, tmp_path
):
    """Generation's layout (decode_step's `prompt`): 2 prompts prefilled once, left-padded to
    the bucket, each read by 2 rows that continue it differently, whose new tokens go to a
    cache of their own; each row's logits are those of the model's call on its prefix alone
    (Gemma's rows run past its 16-token window)."""
    directory = tiny_hf.write_checkpoint(family, tmp_path / family)
    model = meshtrain.load_hf(directory, scan_layers=scan_layers)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, tiny_hf.VOCAB, (4, 32)).astype(np.int32)  # [B, T]
    tokens[1, :PROMPT], tokens[3, :PROMPT] = tokens[0, :PROMPT], tokens[2, :PROMPT]
    pad = BUCKET - PROMPT
    padded = np.zeros((2, BUCKET), np.int32)  # [N, BUCKET]: the prompts after their padding
    padded[:, pad:] = tokens[::2, :PROMPT]
    logits, prompt = _prefill(
        model, padded, np.int32(BUCKET), cache_length=BUCKET, pad=np.full(2, pad, np.int32)
    )
    steps = tokens.shape[1] - PROMPT
    cache = decode.init_cache(model, 4, steps)  # the rows' own slots, BUCKET on
    rows_pad = np.full(4, pad, np.int32)
    rows = [np.repeat(np.asarray(logits), 2, axis=0)]  # [B, V] each
    for i in range(steps - 1):
        step_tokens = tokens[:, PROMPT + i : PROMPT + i + 1]  # [B, 1]
        logits, cache = _step(model, step_tokens, np.int32(BUCKET + i), cache, rows_pad, prompt)
        rows.append(np.asarray(logits))
    for row in range(4):
        full = np.asarray(model(tokens[row : row + 1]))[0]  # [T, V]
        errs = [tiny_hf.relative_error(r[row], full[PROMPT - 1 + i]) for i, r in enumerate(rows)]
        assert max(errs) <= CACHED_TOLERANCE, (row, errs)
    assert not np.allclose(rows[-1][0], rows[-1][1])  # the rows of a group went their own ways
