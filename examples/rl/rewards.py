"""Reward functions for docs/rl.md's walk-through, written as trl's GRPOTrainer takes them:
keyword arguments (the prompts, the completions, their token ids and every other column of the
prompt records, here `answer`), one float per completion. Used as
'objective.rewards=[examples/rl/rewards.py:short_answer,examples/rl/rewards.py:correct_sum]'."""

import re


def _text(completion):
    """A completion's text: the string itself, or a conversation's assistant message."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def short_answer(completions, **kwargs):
    """1 for an answer that is a number alone (`72`), 0 otherwise (`The sum is 72.`)."""
    return [1.0 if re.fullmatch(r"\s*\d+\s*", _text(c)) else 0.0 for c in completions]


def correct_sum(completions, answer, **kwargs):
    """1 when the first number the completion writes is the right sum, 0 otherwise."""
    numbers = [re.search(r"\d+", _text(c)) for c in completions]
    return [1.0 if n and n.group() == a else 0.0 for n, a in zip(numbers, answer, strict=True)]
