"""Completions as rows (meshtrain.rl.rows): the prompt untrained and marked as the document's
start, the completion trained (or not, when masked), padding untrained; K completions of one
prompt as branches after it; how many a row holds; and the advantages' bits in the next columns
(with a generation that feeds several updates, also the token share and the old
log-probabilities), read back exactly on the device."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.config import compose_config

from meshtrain.data.chat.marks import BRANCH_START, DOCUMENT_START, ID_BITS, NOT_TRAINED
from meshtrain.rl.rows import RowLayout, completions_per_row


def test_a_row_is_the_prompt_untrained_then_the_completion_then_padding():
    prompts = [np.array([5, 6, 7], np.int32), np.array([9], np.int32)]
    completions = [np.array([11, 12], np.int32), np.array([13, 14, 15], np.int32)]
    layout = RowLayout(6)
    rows = layout.token_rows(prompts, completions, np.array([True, False]))
    np.testing.assert_array_equal(rows & ID_BITS, [[5, 6, 7, 11, 12, 0], [9, 13, 14, 15, 0, 0]])
    trained = (rows & NOT_TRAINED) == 0
    np.testing.assert_array_equal(trained, [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    starts = (rows & DOCUMENT_START) != 0
    np.testing.assert_array_equal(starts, [[1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    assert not np.any(rows & BRANCH_START)
    with pytest.raises(ValueError, match="a prompt of 3 and 1 completions of up to 2 tokens do"):
        RowLayout(4).token_rows(prompts[:1], completions[:1], np.array([True]))


def test_completions_of_one_prompt_are_branches_after_it_once():
    """K = 3: the prompt without its last token, then each completion after that token."""
    prompt = np.array([5, 6, 7], np.int32)
    completions = [np.array([11, 12], np.int32), np.array([13], np.int32), np.array([14, 15])]
    layout = RowLayout.of(seq_len=6, max_new_tokens=2, completions=3, buffered=False)
    assert layout.tokens == 7 + 2 * 3
    rows = layout.token_rows([prompt] * 3, completions, np.array([True, False, True]))
    np.testing.assert_array_equal(rows & ID_BITS, [[5, 6, 7, 11, 12, 7, 13, 7, 14, 15, 0, 0, 0]])
    trained = (rows & NOT_TRAINED) == 0
    np.testing.assert_array_equal(trained, [[0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0]])
    branches = (rows & BRANCH_START) != 0
    np.testing.assert_array_equal(branches, [[0, 0, 1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0]])
    assert np.flatnonzero(rows & DOCUMENT_START).tolist() == [0]


@pytest.mark.parametrize(
    ("overrides", "per_device", "expected"),
    [
        ((), 16, 8),  # the whole group
        ((), 4, 4),  # a device trains on 4 completions: half a group a row
        ((), 12, 4),
        (("objective.num_generations=6",), 4, 2),
        (("data.shared_prompt=false",), 16, 1),
        (("data.document_masking=false",), 16, 1),
        # A sliding window of 100: a row of K completions is 41 + 17·(K − 1) tokens long.
        (("model.attention_pattern=[local]", "model.sliding_window=100"), 16, 4),
    ],
)
def test_a_row_holds_the_most_completions_a_device_and_the_window_allow(
    overrides, per_device, expected
):
    cfg = compose_config(
        "data=prompts",
        "objective=grpo",
        "objective.num_generations=8",
        "objective.max_new_tokens=16",
        "data.seq_len=40",
        *overrides,
    )
    assert completions_per_row(cfg, per_device) == expected


@pytest.mark.parametrize("buffered", [False, True])
def test_the_rollout_travels_in_the_rows_bit_for_bit(buffered):
    layout = RowLayout(4, completions=2, buffered=buffered)
    tokens = np.arange(12, dtype=np.int32).reshape(3, 4)
    advantages = np.array([[-1.5, 1.0], [0.0, 2.0], [3.25e-7, -4.0]], np.float32)
    share = np.array([2.5, 2.5, 2.5], np.float32)
    old = -np.arange(9, dtype=np.float32).reshape(3, 3) / 7
    rows = layout.with_rollout(tokens, advantages, share, old)
    assert rows.shape == (3, layout.width) == (3, 4 + 2 + 4 * buffered)
    assert RowLayout.from_width(layout.width, 2, buffered) == layout
    back = layout.split(rows)
    np.testing.assert_array_equal(back.tokens, tokens)
    np.testing.assert_array_equal(np.asarray(back.advantages), advantages)
    if not buffered:
        assert back.token_share is None and back.old_log_probs is None
        return
    np.testing.assert_array_equal(np.asarray(back.token_share), share)
    np.testing.assert_array_equal(np.asarray(back.old_log_probs), old)
