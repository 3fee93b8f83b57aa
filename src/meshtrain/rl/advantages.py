"""Group-relative advantages (GRPO): each completion's reward against the other completions of
its prompt, as trl's GRPOTrainer computes them.

rewards [N] hold the completions of N / G prompts, the G of one prompt next to each other (G =
objective.num_generations). A reward that is nan (no reward function scored the completion) is
left out of its group's mean and std, and its advantage is 0. With r̄ and s the mean and the
sample standard deviation (Bessel-corrected, as torch's std) of the group's rewards:

  group   A = (r − r̄) / (s + 1e-4)
  batch   A = (r − r̄) / (s_batch + 1e-4), s_batch over every reward of the batch
  none    A = r − r̄                      (Dr. GRPO)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

STD_EPSILON = 1e-4  # trl's


@dataclass(frozen=True)
class Advantages:
    """The advantages of a batch, and trl's metrics of its rewards."""

    values: np.ndarray  # float32 [N]
    reward: float  # the mean reward (nan left out)
    reward_std: float  # the sample std of every reward of the batch
    frac_reward_zero_std: float  # the share of completions whose std (group or batch) is 0


def nanstd(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    """The sample standard deviation, nan left out (trl.trainer.utils.nanstd)."""
    count = np.sum(~np.isnan(values), axis=axis)
    mean = np.nanmean(values, axis=axis, keepdims=axis is not None)
    variance = np.nanmean((values - mean) ** 2, axis=axis) * count / np.maximum(count - 1, 1)
    return np.sqrt(np.where(count > 1, variance, np.nan))


def group_advantages(rewards: np.ndarray, num_generations: int, scale: str) -> Advantages:
    """The advantages of rewards float [N] (see the module docstring); `scale`:
    objective.scale_rewards (group, batch or none)."""
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim != 1 or rewards.size % num_generations:
        raise ValueError(
            f"{rewards.shape} rewards are not whole groups of {num_generations} completions"
        )
    groups = rewards.reshape(-1, num_generations)
    # A group that no reward function scored has a nan mean (then advantages 0): not a warning.
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.repeat(np.nanmean(groups, axis=1), num_generations)
        batch_std = nanstd(rewards)
        if scale == "batch":
            std = np.full_like(rewards, batch_std)
        else:
            std = np.repeat(nanstd(groups, axis=1), num_generations)
        advantages = rewards - mean
        if scale != "none":
            advantages = advantages / (std + STD_EPSILON)
        reward = float(np.nanmean(rewards))
    return Advantages(
        np.where(np.isnan(advantages), 0.0, advantages).astype(np.float32),
        reward=reward,
        reward_std=float(batch_std),
        frac_reward_zero_std=float(np.mean(np.isclose(std, 0.0))),
    )
