"""Sampled completions as rows of the train batch, then what the loss reads of the rollout, as
float32 bits in int32 columns, so that a row travels through the step's splits (accumulation,
dp grouping) like any other (train.objectives.policy_gradient reads it).

A row holds K completions of one prompt (`RowLayout.completions`, K divides
objective.num_generations; `completions_per_row`):

- K = 1: the prompt's tokens (not trained, the first marked as the document's start), the
  completion's tokens (trained, up to and with the stop token; none trained when the completion
  is masked), then padding (not trained);
- K > 1 (data.shared_prompt): the prompt once, without its last token, then K branches
  (meshtrain.data.chat.marks' BRANCH_START), each the prompt's last token (not trained; its
  output predicts the completion's first token) and a completion, then padding. A branch sees
  the prompt and itself, at the positions it would have right after the prompt
  (train.documents), so each completion's log-probabilities are those of prompt + completion
  alone, and the prompt is computed once for K completions.

Columns, with T the token columns (seq_len + 1 for K = 1; (K − 1)·(1 + max_new_tokens) more for
K completions):

    [tokens: T][advantages: K]                                  a generation a step
    [tokens: T][advantages: K][token share: 1][old: T − 1]      a generation feeds several
                                                                updates

With objective.num_iterations × steps_per_generation > 1 the policy moves between sampling and
the update, so a row also carries each target's log-probability under the policy that sampled
it (old, 0 where the target carries no loss) and its share of the generation's completion
tokens per step (dapo's count: the generation's completion tokens / steps_per_generation, split
evenly over the completions of a step, as trl normalises a generation that spans several
steps)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.config.schema import Config
from meshtrain.data.chat.marks import BRANCH_START, DOCUMENT_START, NOT_TRAINED


@dataclass(frozen=True)
class RolloutRows:
    """RowLayout.with_rollout's rows, read back on the device."""

    tokens: jax.Array  # int32 [B, T]
    advantages: jax.Array  # fp32 [B, K], each completion's
    token_share: jax.Array | None  # fp32 [B], the row's
    old_log_probs: jax.Array | None  # fp32 [B, T − 1]


@dataclass(frozen=True)
class RowLayout:
    """How a row holds its completions and their rollout (see the module docstring)."""

    tokens: int  # T: token columns
    completions: int = 1  # K: completions of one prompt a row holds
    buffered: bool = False  # the rows carry the old log-probabilities and token shares

    @classmethod
    def of(cls, seq_len: int, max_new_tokens: int, completions: int, buffered: bool) -> RowLayout:
        """The layout of K = `completions` a row, where a prompt and one completion fit
        seq_len + 1 tokens (the prompt at most seq_len + 1 − max_new_tokens)."""
        tokens = seq_len + 1 + (completions - 1) * (1 + max_new_tokens)
        return cls(tokens, completions, buffered)

    @classmethod
    def from_width(cls, width: int, completions: int, buffered: bool) -> RowLayout:
        """The layout of rows `width` columns wide: `width`'s inverse."""
        tokens = (width - completions) // 2 if buffered else width - completions
        return cls(tokens, completions, buffered)

    @property
    def width(self) -> int:
        """Columns: the tokens, then the rollout's (see the module docstring)."""
        return self.tokens + self.completions + (self.tokens if self.buffered else 0)

    def token_rows(
        self, prompts: list[np.ndarray], completions: list[np.ndarray], trained: np.ndarray
    ) -> np.ndarray:
        """int32 [N / K, T]: the completions (int32 [c] each, N of them) after their prompts
        (int32 [p] each, one per completion; each K in a row share theirs), a completion trained
        where `trained` (bool [N]) says."""
        k = self.completions
        rows = np.full((len(prompts) // k, self.tokens), NOT_TRAINED, np.int32)
        for index, row in enumerate(rows):
            group = slice(index * k, (index + 1) * k)
            prompt, answers = prompts[group.start], completions[group]
            shared = prompt[:-1] if k > 1 else prompt
            row[: shared.size] = shared | NOT_TRAINED
            at = shared.size
            for completion, train in zip(answers, trained[group], strict=True):
                end = at + (k > 1) + completion.size
                if end > self.tokens:
                    raise ValueError(
                        f"a prompt of {prompt.size} and {k} completions of up to "
                        f"{max(c.size for c in answers)} tokens do not fit a row of "
                        f"{self.tokens}"
                    )
                if k > 1:  # the branch opens with the prompt's last token
                    row[at] = prompt[-1] | NOT_TRAINED | BRANCH_START
                    at += 1
                row[at:end] = completion if train else completion | NOT_TRAINED
                at = end
            row[0] |= DOCUMENT_START
        return rows

    def with_rollout(
        self,
        tokens: np.ndarray,
        advantages: np.ndarray,
        token_share: np.ndarray | None = None,
        old_log_probs: np.ndarray | None = None,
    ) -> np.ndarray:
        """Rows of tokens int32 [..., T] with their completions' advantages float [..., K]
        (and, buffered, the rows' token shares float [...] and old log-probabilities float
        [..., T − 1]) → int32 [..., width]."""
        columns = [advantages]
        if self.buffered:
            columns += [token_share[..., None], old_log_probs]
        bits = np.concatenate([np.asarray(c, np.float32) for c in columns], axis=-1).view(np.int32)
        return np.concatenate([np.asarray(tokens, np.int32), bits], axis=-1)

    def split(self, rows: jax.Array) -> RolloutRows:
        """with_rollout's rows int32 [B, width] → their parts."""
        tokens, rest = rows[:, : self.tokens], rows[:, self.tokens :]
        floats = jax.lax.bitcast_convert_type(rest, jnp.float32)
        advantages = floats[:, : self.completions]
        if not self.buffered:
            return RolloutRows(tokens, advantages, None, None)
        return RolloutRows(
            tokens, advantages, floats[:, self.completions], floats[:, self.completions + 1 :]
        )


def completions_per_row(cfg: Config, per_device: int) -> int:
    """K of a policy-gradient run whose devices each train on `per_device` completions a
    micro-batch: with data.shared_prompt (and document masking, which keeps the branches apart)
    the most completions of a group that a row can hold: a divisor of objective.num_generations
    that divides `per_device` (a device trains on whole rows), with the row no longer than the
    model's sliding window, if it has one (a branch must see its prompt); else 1."""
    objective, data, model = cfg.objective, cfg.data, cfg.model
    if not (data.shared_prompt and data.document_masking):
        return 1
    window = model.sliding_window if "local" in model.attention_pattern else None
    for k in range(objective.num_generations, 1, -1):
        layout = RowLayout.of(data.seq_len, objective.max_new_tokens, k, buffered=False)
        fits = window is None or layout.tokens - 1 <= window
        if objective.num_generations % k == 0 and per_device % k == 0 and fits:
            return k
    return 1
