"""The reward functions meshtrain ships, named in objective.rewards without a module:

    exact_match   1 when the completion's answer equals the record's objective.answer_column,
                  else 0 (None where the record has no answer). The answer is the whole
                  completion, stripped; with objective.answer_pattern, the pattern's first group
                  (or its whole match, if it has no group) at its first match, 0 where it does
                  not match.
    format_match  1 when the whole completion matches objective.format_pattern (re.fullmatch,
                  `.` matching newlines), else 0.

Each is bound to its keys at start-up (`builtin_reward`), where a pattern that does not compile is
one line, and called as trl calls reward functions (meshtrain.rl.rewards)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

from meshtrain.config.objective import ObjectiveConfig
from meshtrain.errors import ConfigError, require

BUILTIN_REWARDS = ("exact_match", "format_match")


def completion_text(completion: Any) -> str:
    """A completion's text: the string itself, or a conversation's assistant message."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def exact_match(
    completions: Sequence[Any], *, answers: Sequence[Any], pattern: re.Pattern | None
) -> list[float | None]:
    """See the module docstring; `answers`: each completion's record's answer column."""
    scores: list[float | None] = []
    for completion, answer in zip(completions, answers, strict=True):
        if answer is None:
            scores.append(None)
            continue
        text = completion_text(completion)
        if pattern is not None:
            found = pattern.search(text)
            if found is None:
                scores.append(0.0)
                continue
            text = found.group(1) if pattern.groups else found.group(0)
        scores.append(float(text.strip() == str(answer).strip()))
    return scores


def format_match(completions: Sequence[Any], *, pattern: re.Pattern) -> list[float]:
    """See the module docstring."""
    return [float(pattern.fullmatch(completion_text(c)) is not None) for c in completions]


def builtin_reward(name: str, cfg: ObjectiveConfig) -> Callable[..., list[float | None]]:
    """The built-in `name` bound to its objective keys, as a trl-style reward function."""
    if name == "exact_match":
        pattern = _compiled("objective.answer_pattern", cfg.answer_pattern)
        column = cfg.answer_column

        def exact_match_reward(completions: Sequence[Any], **columns: Any) -> list[float | None]:
            return exact_match(completions, answers=columns[column], pattern=pattern)

        return functools.update_wrapper(exact_match_reward, exact_match)
    require(
        cfg.format_pattern is not None,
        "objective.rewards names format_match: set objective.format_pattern to the regular "
        "expression a whole completion must match",
    )
    pattern = _compiled("objective.format_pattern", cfg.format_pattern, re.DOTALL)

    def format_match_reward(completions: Sequence[Any], **columns: Any) -> list[float]:
        return format_match(completions, pattern=pattern)

    return functools.update_wrapper(format_match_reward, format_match)


def _compiled(key: str, pattern: str | None, flags: int = 0) -> re.Pattern | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern, flags)
    except re.error as err:
        raise ConfigError(f"{key}={pattern!r} is not a regular expression ({err})") from None
