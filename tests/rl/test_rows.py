"""A completion as a row (meshtrain.rl.rows): the prompt untrained and marked as the document's
start, the completion trained (or not, when masked), padding untrained, and the advantage's
bits in the next column (with a generation that feeds several updates, also the token share and
the old log-probabilities), read back exactly on the device."""

from __future__ import annotations

import numpy as np
import pytest

from meshtrain.data.chat.marks import DOCUMENT_START, ID_BITS, NOT_TRAINED
from meshtrain.rl.rows import completion_rows, rollout_columns, split_rollout, with_rollout


def test_a_row_is_the_prompt_untrained_then_the_completion_then_padding():
    prompts = [np.array([5, 6, 7], np.int32), np.array([9], np.int32)]
    completions = [np.array([11, 12], np.int32), np.array([13, 14, 15], np.int32)]
    rows = completion_rows(prompts, completions, np.array([True, False]), 6)
    np.testing.assert_array_equal(rows & ID_BITS, [[5, 6, 7, 11, 12, 0], [9, 13, 14, 15, 0, 0]])
    trained = (rows & NOT_TRAINED) == 0
    np.testing.assert_array_equal(trained, [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    starts = (rows & DOCUMENT_START) != 0
    np.testing.assert_array_equal(starts, [[1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match="a prompt of 3 and a completion of 2 tokens do not fit"):
        completion_rows(prompts[:1], completions[:1], np.array([True]), 4)


def test_the_rollout_travels_in_the_rows_bit_for_bit():
    tokens = np.arange(12, dtype=np.int32).reshape(3, 4)  # seq_len 3
    advantages = np.array([-1.5, 0.0, 3.25e-7], np.float32)
    rows = with_rollout(tokens, advantages)
    assert rows.shape == (3, 4 + rollout_columns(3, buffered=False))
    back = split_rollout(rows, buffered=False)
    np.testing.assert_array_equal(back.tokens, tokens)
    np.testing.assert_array_equal(np.asarray(back.advantages), advantages)
    assert back.token_share is None and back.old_log_probs is None

    share = np.array([2.5, 2.5, 2.5], np.float32)
    old = -np.arange(9, dtype=np.float32).reshape(3, 3) / 7
    rows = with_rollout(tokens, advantages, share, old)
    assert rows.shape == (3, 4 + rollout_columns(3, buffered=True)) == (3, 9)
    back = split_rollout(rows, buffered=True)
    np.testing.assert_array_equal(back.tokens, tokens)
    np.testing.assert_array_equal(np.asarray(back.advantages), advantages)
    np.testing.assert_array_equal(np.asarray(back.token_share), share)
    np.testing.assert_array_equal(np.asarray(back.old_log_probs), old)
