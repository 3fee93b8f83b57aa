"""The shipped reward functions (meshtrain.rl.builtin_rewards), named in objective.rewards
without a module: exact_match against a column, with and without an answer pattern, None where a
record has no answer; format_match against a whole completion; bad patterns, a format_match
without its pattern and a column the records lack are one line at start-up."""

from __future__ import annotations

import numpy as np
import pytest

from meshtrain.config.objective import ObjectiveConfig
from meshtrain.errors import ConfigError
from meshtrain.rl.prompts import Prompt
from meshtrain.rl.rewards import Rewards
from meshtrain.rl.setup import _check_answer_column

CHATS = [
    [{"role": "assistant", "content": text}]
    for text in (" 49\n", "The sum is 49.", "<think>add</think> 50", "49", "")
]


def _score(rewards: Rewards, answers: list) -> np.ndarray:
    count = len(CHATS)
    columns = [{"solution": a} for a in answers]
    return rewards.score(["p"] * count, CHATS, [[1]] * count, columns)


def test_exact_match_compares_the_whole_completion_or_the_patterns_answer():
    cfg = ObjectiveConfig(name="grpo", answer_column="solution")
    whole = Rewards(["exact_match"], cfg=cfg)
    assert whole.names == ["exact_match"]
    answers = ["49", "49", "50", None, "0"]
    np.testing.assert_array_equal(_score(whole, answers)[:, 0], [1, 0, 0, np.nan, 0])
    cfg.answer_pattern = r"(\d+)\s*$"  # the number that ends the completion: its group
    last_number = Rewards(["exact_match"], cfg=cfg)  # "The sum is 49." ends with a full stop
    np.testing.assert_array_equal(_score(last_number, answers)[:, 0], [1, 0, 1, np.nan, 0])
    cfg.answer_pattern = r"\d+"  # no group: the whole first match
    first_number = Rewards(["exact_match"], cfg=cfg)
    np.testing.assert_array_equal(_score(first_number, answers)[:, 0], [1, 1, 1, np.nan, 0])


def test_format_match_needs_the_whole_completion_to_match():
    cfg = ObjectiveConfig(name="grpo", format_pattern=r"<think>.*</think>\s*\d+")
    rewards = Rewards(["format_match", "exact_match"], [0.5, 1.0], cfg)
    count = len(CHATS)
    scores = rewards.score(["p"] * count, CHATS, [[1]] * count, [{"answer": "50"}] * count)
    np.testing.assert_array_equal(scores, [[0, 0], [0, 0], [1, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(rewards.total(scores), [0, 0, 0.5, 0, 0])
    multiline = [[{"role": "assistant", "content": "<think>a\nb</think> 7"}]]
    assert rewards.score(["p"], multiline, [[1]], [{"answer": "7"}]).tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize(
    ("cfg", "specs", "message"),
    [
        (
            ObjectiveConfig(name="grpo"),
            ["format_match"],
            "objective.rewards names format_match: set objective.format_pattern to the regular "
            "expression a whole completion must match",
        ),
        (
            ObjectiveConfig(name="grpo", answer_pattern="(\\d+"),
            ["exact_match"],
            "objective.answer_pattern='(\\\\d+' is not a regular expression (missing ), "
            "unterminated subpattern at position 0)",
        ),
    ],
)
def test_a_builtin_without_a_working_pattern_is_one_line(cfg, specs, message):
    with pytest.raises(ConfigError) as error:
        Rewards(specs, cfg=cfg)
    assert str(error.value) == message


def test_records_without_the_answer_column_are_one_line():
    ids = np.array([1], np.int32)
    prompts = [
        Prompt(ids, (2,), "a", {"answer": "1"}),
        Prompt(ids, (2,), "b", {"solution": "2"}),
    ]
    _check_answer_column("answer", prompts[:1])
    with pytest.raises(ConfigError) as error:
        _check_answer_column("answer", prompts)
    assert str(error.value) == (
        "objective.answer_column='answer': 1 of 2 records of data.paths have no such column (a "
        "record's columns: solution); set objective.answer_column to the column exact_match "
        "compares with"
    )
