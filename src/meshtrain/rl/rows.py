"""A sampled completion as a row of the train batch: its prompt's tokens (not trained, the first
marked as the document's start), the completion's tokens (trained, up to and with the stop token;
none trained when the completion is masked), padding (not trained), then one more column: the
completion's advantage, its float32 bits in an int32, so that the row travels through the step's
splits (accumulation, dp grouping) like any other (train.objectives.policy_gradient reads it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.data.chat.marks import DOCUMENT_START, NOT_TRAINED


def completion_rows(
    prompts: list[np.ndarray], completions: list[np.ndarray], trained: np.ndarray, length: int
) -> np.ndarray:
    """int32 [N, length]: each prompt (int32 [p]) followed by its completion (int32 [c]),
    p + c <= length, the completion trained where `trained` (bool [N]) says."""
    rows = np.full((len(prompts), length), NOT_TRAINED, np.int32)
    for row, prompt, completion, train in zip(rows, prompts, completions, trained, strict=True):
        end = prompt.size + completion.size
        if end > length:
            raise ValueError(
                f"a prompt of {prompt.size} and a completion of {completion.size} "
                f"tokens do not fit a row of {length}"
            )
        row[: prompt.size] = prompt | NOT_TRAINED
        row[prompt.size : end] = completion if train else completion | NOT_TRAINED
        row[0] |= DOCUMENT_START
    return rows


def with_advantages(tokens: np.ndarray, advantages: np.ndarray) -> np.ndarray:
    """Rows of tokens int32 [B, L] and advantages float [B] → int32 [B, L + 1], the advantage's
    float32 bits last."""
    bits = np.asarray(advantages, np.float32).view(np.int32)
    return np.concatenate([np.asarray(tokens, np.int32), bits[:, None]], axis=1)


def split_advantages(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """with_advantages' rows, on the device → (tokens int32 [B, L], advantages fp32 [B])."""
    return rows[:, :-1], jax.lax.bitcast_convert_type(rows[:, -1], jnp.float32)
