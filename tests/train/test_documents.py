"""Document masking: segment ids and positions read off packed tokens, and a packed sequence's
logits equal to each of its documents run on its own (a branched document's: each branch's
equal to its document's start and itself)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.config import compose_config

from meshtrain.data.chat.marks import BRANCH_START, DOCUMENT_START, NOT_TRAINED
from meshtrain.data.tokenizer import NO_TOKEN
from meshtrain.models.attention import BRANCH_SHIFT
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


def test_branches_see_their_documents_start_and_continue_its_positions():
    # A pair stored with its prompt once (data.shared_prompt): prompt [1, 2], then two branches,
    # each opening with the prompt's last token (3); then a pair whose prompt is that one token,
    # so that its first branch opens the document; then padding.
    ids = np.asarray([[1, 2, 3, 10, 11, 3, 20, 3, 30, 3, 40, 41, 0]])
    marks = np.zeros_like(ids)
    marks[0, [0, 7]] |= DOCUMENT_START
    marks[0, [2, 5, 7, 9]] |= BRANCH_START
    tokens = jnp.asarray(ids | marks, dtype=jnp.int32)
    boundaries = DocumentBoundaries(bos_id=NO_TOKEN, eos_id=EOS)
    _, _, _, segment_ids, positions = TokenFormat(documents=boundaries, flagged=True).read(tokens)
    branch = 1 << BRANCH_SHIFT
    expected = [1, 1, 1 + branch, 1 + branch, 1 + branch, 1 + 2 * branch, 1 + 2 * branch]
    expected += [2 + branch, 2 + branch, 2 + 2 * branch, 2 + 2 * branch, 2 + 2 * branch]
    np.testing.assert_array_equal(segment_ids, [expected])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 3, 4, 2, 3, 0, 1, 0, 1, 2]])
    # Plain documents keep branch 0: their segment ids are the document count, as before.
    plain = jnp.asarray(ids | (marks & DOCUMENT_START), dtype=jnp.int32)
    _, _, _, segment_ids, _ = TokenFormat(documents=boundaries, flagged=True).read(plain)
    np.testing.assert_array_equal(segment_ids, [[1] * 7 + [2] * 5])


def test_each_branch_has_the_logits_of_its_prompt_and_answer_alone():
    model = Transformer(compose_config().model, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompt, chosen, rejected = (rng.integers(0, 256, n) for n in (41, 30, 57))  # T > 64: blocks
    ids = np.concatenate([prompt, chosen, prompt[-1:], rejected, [PAD] * 3])
    marks = np.zeros(len(ids), np.int64)
    marks[0] |= DOCUMENT_START
    marks[[40, 71]] |= BRANCH_START  # each branch opens with the prompt's last token
    tokens = jnp.asarray((ids | marks)[None], jnp.int32)
    boundaries = DocumentBoundaries(bos_id=NO_TOKEN, eos_id=EOS)
    inputs, _, _, segment_ids, positions = TokenFormat(documents=boundaries, flagged=True).read(
        tokens
    )
    forward = jax.jit(lambda t, p=None, s=None: model(t, p, s))
    logits = forward(inputs, positions, segment_ids)[0]  # [T, V]
    for answer, at in ((chosen, 40), (rejected, 71)):
        alone = forward(jnp.asarray(np.concatenate([prompt, answer])[None], jnp.int32))[0]
        np.testing.assert_allclose(logits[:40], alone[:40], rtol=1e-5, atol=2e-5)  # the prompt
        branch = logits[at : at + 1 + len(answer)]  # the prompt's last token, then the answer
        np.testing.assert_allclose(branch, alone[40 : 41 + len(answer)], rtol=1e-5, atol=2e-5)
