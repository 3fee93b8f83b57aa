"""Group-relative advantages (meshtrain.rl.advantages), worked by hand: each scaling, a group
whose rewards are all equal, and a completion no reward function scored."""

from __future__ import annotations

import numpy as np
import pytest

from meshtrain.rl.advantages import STD_EPSILON, group_advantages

# Two prompts of four completions: the first group's mean 0.5 and sample std sqrt(1/3); the
# second's rewards all equal.
REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])


def test_group_scaling_divides_by_each_groups_sample_std():
    result = group_advantages(REWARDS, num_generations=4, scale="group")
    first = 0.5 / (np.sqrt(1 / 3) + STD_EPSILON)
    np.testing.assert_allclose(result.values, [first, -first, -first, first, 0, 0, 0, 0], 1e-6)
    assert result.values.dtype == np.float32
    assert result.reward == pytest.approx(1.25)
    assert result.reward_std == pytest.approx(np.std(REWARDS, ddof=1))
    assert result.frac_reward_zero_std == 0.5


def test_batch_scaling_and_no_scaling():
    batch_std = np.std(REWARDS, ddof=1)
    batch = group_advantages(REWARDS, num_generations=4, scale="batch")
    expected = (REWARDS - np.repeat([0.5, 2.0], 4)) / (batch_std + STD_EPSILON)
    np.testing.assert_allclose(batch.values, expected, rtol=1e-6)
    assert batch.frac_reward_zero_std == 0.0
    none = group_advantages(REWARDS, num_generations=4, scale="none")
    np.testing.assert_allclose(none.values, REWARDS - np.repeat([0.5, 2.0], 4), rtol=1e-6)


def test_an_unscored_completion_is_left_out_and_gets_no_advantage():
    rewards = np.array([1.0, np.nan, 0.0, 2.0])
    result = group_advantages(rewards, num_generations=4, scale="none")
    np.testing.assert_allclose(result.values, [0.0, 0.0, -1.0, 1.0], atol=1e-7)  # mean 1
    assert result.reward == pytest.approx(1.0)
    unscored = group_advantages(np.full(4, np.nan), num_generations=2, scale="group")
    np.testing.assert_array_equal(unscored.values, np.zeros(4, np.float32))


def test_rewards_that_are_not_whole_groups_are_refused():
    with pytest.raises(ValueError, match=r"^\(6,\) rewards are not whole groups of 4 completions"):
        group_advantages(np.zeros(6), num_generations=4, scale="group")
