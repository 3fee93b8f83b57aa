"""Document masking: segment ids and positions read off packed tokens, and a packed sequence's
logits equal to each of its documents run on its own."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.config import compose_config

from meshtrain.data.chat.marks import DOCUMENT_START, NOT_TRAINED
from meshtrain.data.tokenizer import NO_TOKEN
from meshtrain.models.transformer import Transformer
from meshtrain.train.documents import DocumentBoundaries, TokenFormat, document_boundaries

BOS, EOS, PAD = 257, 258, 256


def test_segments_restart_at_each_bos():
    inputs = jnp.asarray([[5, 6, EOS, BOS, 7, EOS, BOS, 8], [BOS, 1, 2, 3, EOS, PAD, PAD, PAD]])
    segment_ids, positions = DocumentBoundaries(bos_id=BOS, eos_id=EOS).segments(inputs)
    # A document continued from the previous sequence is the first segment, from position 0.
    np.testing.assert_array_equal(segment_ids, [[0, 0, 0, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert segment_ids.dtype == positions.dtype == jnp.int32


def test_without_bos_documents_start_after_each_eos():
    inputs = jnp.asarray([[5, EOS, 6, 7, EOS, EOS, 9]])
    segment_ids, positions = DocumentBoundaries(bos_id=NO_TOKEN, eos_id=EOS).segments(inputs)
    np.testing.assert_array_equal(segment_ids, [[0, 0, 1, 1, 1, 2, 3]])
    np.testing.assert_array_equal(positions, [[0, 1, 0, 1, 2, 0, 0]])


def test_boundaries_come_from_the_tokenizer_and_stop_where_masking_is_off():
    data = compose_config().data
    assert document_boundaries(data) == DocumentBoundaries(bos_id=BOS, eos_id=EOS)
    assert document_boundaries(dataclasses.replace(data, document_masking=False)) is None
    assert document_boundaries(compose_config("data=synthetic").data) is None


def test_no_target_is_trained_across_a_packed_conversations_start():
    # Two conversations trained whole (data.train_on=all), then padding: the second one's first
    # token (12) is the target of the first one's last input (11) and carries no loss.
    ids = np.asarray([[1, 10, 11, 2, 12, 13, 0, 0]])
    marks = np.zeros_like(ids)
    marks[0, [0, 3]] |= DOCUMENT_START
    marks[0, 6:] |= NOT_TRAINED
    tokens = jnp.asarray(ids | marks, dtype=jnp.int32)
    boundaries = DocumentBoundaries(bos_id=NO_TOKEN, eos_id=EOS)
    inputs, targets, mask, segment_ids, positions = TokenFormat(
        documents=boundaries, flagged=True
    ).read(tokens)
    np.testing.assert_array_equal(inputs, [[1, 10, 11, 2, 12, 13, 0]])
    np.testing.assert_array_equal(targets, [[10, 11, 2, 12, 13, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(segment_ids, [[1, 1, 1, 2, 2, 2, 2]])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 2, 3]])
    # Without document masking the conversations see each other, and the target is trained.
    _, _, mask, _, _ = TokenFormat(flagged=True).read(tokens)
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 1, 0, 0]])


@pytest.mark.parametrize(
    "flavour",
    [
        {},  # global attention, the chunked XLA kernel
        {"attention_pattern": ["local", "global"], "sliding_window": 4},  # Gemma-style windows
    ],
)
def test_packed_logits_equal_each_document_alone(flavour):
    cfg = dataclasses.replace(compose_config().model, **flavour)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 256, n) for n in (9, 3, 14)]
    blocks = [np.concatenate([[BOS], d, [EOS]]) for d in documents]
    packed = np.concatenate([*blocks, [PAD, PAD]])[None].astype(np.int32)  # [1, 34]
    segment_ids, positions = DocumentBoundaries(bos_id=BOS, eos_id=EOS).segments(packed)
    forward = jax.jit(lambda t, p=None, s=None: model(t, p, s))
    logits = forward(packed, positions, segment_ids)[0]
    # Each document alone, in one batch of one shape: a row per document, padded at its end,
    # which causal attention keeps from its tokens' logits.
    longest = max(map(len, blocks))
    rows = np.stack([np.pad(b, (0, longest - len(b)), constant_values=PAD) for b in blocks])
    alone_rows = forward(jnp.asarray(rows, jnp.int32))  # [documents, longest, V]
    start = 0
    for block, row in zip(blocks, alone_rows, strict=True):
        alone = row[: len(block)]  # [len, V]
        np.testing.assert_allclose(logits[start : start + len(block)], alone, rtol=1e-5, atol=2e-5)
        start += len(block)
    # Without masking, the later documents see the earlier ones: their logits differ.
    unmasked = forward(jnp.asarray(packed))[0]
    assert float(jnp.max(jnp.abs(unmasked[len(blocks[0]) :] - logits[len(blocks[0]) :]))) > 1e-2
