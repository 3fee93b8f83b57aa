"""A sampled completion as a row of the train batch: its prompt's tokens (not trained, the first
marked as the document's start), the completion's tokens (trained, up to and with the stop token;
none trained when the completion is masked), padding (not trained), then what the loss reads of
the rollout, as float32 bits in int32 columns, so that the row travels through the step's splits
(accumulation, dp grouping) like any other (train.objectives.policy_gradient reads it):

    [tokens: seq_len + 1][advantage: 1]                                     a generation a step
    [tokens: seq_len + 1][advantage: 1][token share: 1][old: seq_len]       a generation feeds
                                                                            several updates

With objective.num_iterations × steps_per_generation > 1 the policy moves between sampling and
the update, so a row also carries each target's log-probability under the policy that sampled
it (old, 0 where the target carries no loss) and its share of the generation's completion
tokens per step (dapo's count: the generation's completion tokens / steps_per_generation, split
evenly over the rows of a step, as trl normalises a generation that spans several steps)."""

from __future__ import annotations

from dataclasses import dataclass

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


def rollout_columns(seq_len: int, *, buffered: bool) -> int:
    """The columns a row holds after its seq_len + 1 tokens (see the module docstring)."""
    return 2 + seq_len if buffered else 1


def token_columns(width: int, *, buffered: bool) -> int:
    """The token columns (seq_len + 1) of rows `width` wide: rollout_columns' inverse."""
    return (width - 1) // 2 if buffered else width - 1


def with_rollout(
    tokens: np.ndarray,
    advantages: np.ndarray,
    token_share: np.ndarray | None = None,
    old_log_probs: np.ndarray | None = None,
) -> np.ndarray:
    """Rows of tokens int32 [..., L] with their advantages float [...] (and, for a generation
    that feeds several updates, token shares float [...] and old log-probabilities float
    [..., L − 1]) → int32 [..., L + rollout_columns(L − 1)]."""
    columns = [advantages[..., None]]
    if old_log_probs is not None:
        columns += [token_share[..., None], old_log_probs]
    bits = np.concatenate([np.asarray(c, np.float32) for c in columns], axis=-1).view(np.int32)
    return np.concatenate([np.asarray(tokens, np.int32), bits], axis=-1)


@dataclass(frozen=True)
class RolloutRows:
    """with_rollout's rows, read back on the device."""

    tokens: jax.Array  # int32 [B, seq_len + 1]
    advantages: jax.Array  # fp32 [B]
    token_share: jax.Array | None  # fp32 [B]
    old_log_probs: jax.Array | None  # fp32 [B, seq_len]


def split_rollout(rows: jax.Array, *, buffered: bool) -> RolloutRows:
    """with_rollout's rows int32 [B, W] → their parts (buffered: they carry the old
    log-probabilities and token shares)."""
    width = token_columns(rows.shape[-1], buffered=buffered)
    tokens, rest = rows[:, :width], rows[:, width:]
    floats = jax.lax.bitcast_convert_type(rest, jnp.float32)
    if not buffered:
        return RolloutRows(tokens, floats[:, 0], None, None)
    return RolloutRows(tokens, floats[:, 0], floats[:, 1], floats[:, 2:])
