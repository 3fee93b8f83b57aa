"""The reward functions of objective.rewards (meshtrain.rl.rewards): loaded from a module or a
file, called with trl's keyword arguments and the records' columns, None read as unscored, the
weighted sum; every wrong name a one-line error at start-up."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.paths import REPO

from meshtrain.errors import ConfigError
from meshtrain.rl.rewards import Rewards, load_reward_function

EXAMPLE = REPO / "examples" / "rl" / "rewards.py"


def test_the_example_functions_score_as_written():
    rewards = Rewards([f"{EXAMPLE}:short_answer", f"{EXAMPLE}:correct_sum"], [1.0, 2.0])
    assert rewards.names == ["short_answer", "correct_sum"]
    completions = [[{"role": "assistant", "content": t}] for t in ("49", "The sum is 49.", "50")]
    scores = rewards.score(
        prompts=[[{"role": "user", "content": "16+33="}]] * 3,
        completions=completions,
        completion_ids=[[1], [2], [3]],
        columns=[{"answer": "49"}] * 3,
    )
    np.testing.assert_array_equal(scores, [[1, 1], [0, 1], [1, 0]])
    np.testing.assert_array_equal(rewards.total(scores), [3, 2, 1])


def test_none_is_unscored_and_a_completion_no_function_scored_is_nan(tmp_path):
    module = tmp_path / "partial.py"
    module.write_text(
        "def only_long(completions, **kwargs):\n"
        "    return [None if len(c) < 3 else 1.0 for c in completions]\n"
        "def length(completions, completion_ids, **kwargs):\n"
        "    return [float(len(i)) for i in completion_ids]\n"
    )
    rewards = Rewards([f"{module}:only_long", f"{module}:length"], [2.0, 0.5])
    scores = rewards.score(["p", "p"], ["ab", "abcd"], [[1, 2], [1, 2, 3, 4]], [{}, {}])
    np.testing.assert_array_equal(scores, [[np.nan, 2], [1, 4]])
    np.testing.assert_array_equal(rewards.total(scores), [1.0, 4.0])
    alone = Rewards([f"{module}:only_long"])
    assert np.isnan(alone.total(alone.score(["p"], ["ab"], [[1]], [{}]))[0])


def test_a_module_path_loads_like_a_file():
    function = load_reward_function("json:dumps", "objective.rewards[0]")
    assert function([1]) == "[1]"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "short_answer",
            "objective.rewards[0]='short_answer' names no function; give 'module:function', "
            "'path/to/file.py:function' or a built-in (exact_match, format_match)",
        ),
        ("missing.py:f", "objective.rewards[0]='missing.py:f': "),
        (
            "no_such_module_xyz:f",
            "objective.rewards[0]='no_such_module_xyz:f': importing "
            "no_such_module_xyz failed (ModuleNotFoundError: ",
        ),
        (
            f"{EXAMPLE}:nothing",
            f"objective.rewards[0]='{EXAMPLE}:nothing': {EXAMPLE} has no "
            "function 'nothing'; give 'module:function', 'path/to/file.py:function' or a "
            "built-in (exact_match, format_match)",
        ),
    ],
)
def test_a_wrong_name_is_one_line(spec, message):
    with pytest.raises(ConfigError) as error:
        Rewards([spec])
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_function_that_raises_or_returns_too_few_rewards_is_named_in_one_line(tmp_path):
    module = tmp_path / "short.py"
    module.write_text(
        "def one(completions, **kwargs):\n    return [1.0]\n"
        "def fails(completions, answer, **kwargs):\n    return [1.0 / len(a) for a in answer]\n"
    )
    rewards = Rewards([f"{module}:fails", f"{module}:one"])
    with pytest.raises(ConfigError) as error:
        rewards.score(["p", "p"], ["a", "b"], [[1], [2]], [{"answer": "1"}, {"answer": ""}])
    assert str(error.value) == (
        "reward function fails (objective.rewards[0]) raised ZeroDivisionError: float division "
        "by zero"
    )
    with pytest.raises(ConfigError) as error:
        rewards.score(["p", "p"], ["a", "b"], [[1], [2]], [{"answer": "1"}, {"answer": "2"}])
    assert str(error.value) == (
        "reward function one (objective.rewards[1]) returned 1 rewards for 2 completions; "
        "return one float (or None) per completion"
    )
