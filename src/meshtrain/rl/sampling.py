"""Completions of prompts sampled from the train state and scored: what a generation of the
training rollouts (meshtrain.rl.rollouts) and an evaluation on held-out prompts
(`ValidationRollouts`) both do.

All the prompts of a call decode together as one batch on the training mesh (meshtrain.inference
.generate's batched program: one prefill of each prompt, held once and read by its
objective.num_generations rows, then decode steps on the device until every row has stopped or
objective.max_new_tokens), from the state's own sharded parameters (with LoRA, the
base and its adapters; nothing is copied), the prompts padded to one width for the run (one
program). The rewards (meshtrain.rl.rewards) and the advantages (meshtrain.rl.advantages) are
computed on the host. Where the mesh spans several processes, each of them samples the same
prompts with the same key (the program's inputs as global arrays), reads every completion and
calls the reward functions on all of them (so they must be deterministic, as trl's are on its
processes' shares), so the rows they build are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.config.objective import ObjectiveConfig
from meshtrain.data.tokenizer import Tokenizer
from meshtrain.inference.generate import generate_ids_batch
from meshtrain.models.abstract import AbstractModel, merge_model
from meshtrain.parallel.arrays import global_array
from meshtrain.rl.advantages import Advantages, group_advantages, nanstd
from meshtrain.rl.prompts import Prompt
from meshtrain.rl.rewards import Rewards


def sampling_seed(seed: int, step: int, *part: int) -> int:
    """The sampling seed of loop step `step` (from 1) of a run with training.seed `seed`; step 0
    with a `part` (the first completion of a batch): an evaluation's."""
    return int(np.random.default_rng([seed, step, *part]).integers(2**31))


@dataclass(frozen=True)
class Scored:
    """Sampled completions of some prompts (each repeated G times, in groups), scored."""

    completions: list[np.ndarray]  # int32 [≤ max_new_tokens] each, with the stop id that ended it
    finished: np.ndarray  # bool [N]: ended by a stop id (else truncated at max_new_tokens)
    scores: np.ndarray  # float64 [N, functions], nan where a function did not score
    advantages: Advantages

    def metrics(self, names: list[str]) -> dict[str, float]:
        """trl's rollout metrics: reward, reward_std, frac_reward_zero_std,
        rewards/<function>/mean and /std, completions/mean_length, /min_length, /max_length,
        /clipped_ratio (the share truncated at max_new_tokens)."""
        lengths = np.array([c.size for c in self.completions])
        per_function = {}
        for j, name in enumerate(names):
            per_function[f"rewards/{name}/mean"] = float(np.nanmean(self.scores[:, j]))
            per_function[f"rewards/{name}/std"] = float(nanstd(self.scores[:, j]))
        return {
            "reward": self.advantages.reward,
            "reward_std": self.advantages.reward_std,
            "frac_reward_zero_std": self.advantages.frac_reward_zero_std,
            **per_function,
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(np.mean(~self.finished)),
        }


class Sampler:
    """Samples completions of prompts from a train state and scores them (module docstring)."""

    def __init__(
        self,
        model: AbstractModel,
        rewards: Rewards,
        tokenizer: Tokenizer,
        cfg: ObjectiveConfig,
        *,
        width: int,
        mesh: Mesh,
    ) -> None:
        self.model, self.rewards, self.tokenizer, self.cfg = model, rewards, tokenizer, cfg
        self.width = width  # every prompt is padded to it: one sampling program
        # The inputs of the sampling program, the same on every process, as global arrays.
        self._put = partial(global_array, sharding=NamedSharding(mesh, PartitionSpec()))

    def sample(self, state: Any, prompts: list[Prompt], seed: int) -> list[np.ndarray]:
        """objective.num_generations completions of each prompt, in groups, sampled from
        `state` (int32 [≤ max_new_tokens] each, with the stop id that ended it, if one did);
        each prompt's prefill is computed once."""
        cfg = self.cfg
        net = merge_model(self.model, self.model.full_params(state.params, state.frozen))
        return generate_ids_batch(
            net,
            [p.ids for p in prompts],
            cfg.max_new_tokens,
            cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            stop_ids=_stop_ids(prompts),
            vocab_size=min(self.tokenizer.vocab_size, self.model.config.vocab_size),
            seed=seed,
            bucket=self.width,
            repeats=cfg.num_generations,
            put=self._put,
        )

    def score(self, prompts: list[Prompt], completions: list[np.ndarray]) -> Scored:
        """The rewards and group advantages of `completions`, one of each prompt (the prompts
        in groups of objective.num_generations)."""
        stop_ids = _stop_ids(prompts)
        finished = np.array([c.size > 0 and int(c[-1]) in stop_ids for c in completions])
        texts = [
            self.tokenizer.decode(c[:-1] if f else c)
            for c, f in zip(completions, finished, strict=True)
        ]
        scores = self.rewards.score(
            [p.prompt for p in prompts],
            [_completion(p, t) for p, t in zip(prompts, texts, strict=True)],
            [c.tolist() for c in completions],
            [p.columns for p in prompts],
        )
        total = self.rewards.total(scores)
        advantages = group_advantages(total, self.cfg.num_generations, self.cfg.scale_rewards)
        return Scored(completions, finished, scores, advantages)


class ValidationRollouts:
    """The held-out prompts (data.validation_paths) sampled and scored as the training rollouts
    are, objective.num_generations completions each, with the same sampling keys at every
    evaluation (so that evaluations differ by the policy only), in batches of `batch` completions
    (the training generation's size: its program serves). Their metrics: Scored.metrics."""

    def __init__(self, sampler: Sampler, prompts: list[Prompt], *, batch: int, seed: int) -> None:
        self.group = sampler.cfg.num_generations
        self.sampler, self.seed, self.prompts = sampler, seed, prompts
        self.batch = batch // self.group  # prompts a batch

    def __call__(self, state: Any) -> dict[str, float]:
        completions: list[np.ndarray] = []
        for start in range(0, len(self.prompts), self.batch):
            chunk = self.prompts[start : start + self.batch]
            padded = chunk + [chunk[0]] * (self.batch - len(chunk))  # one program
            seed = sampling_seed(self.seed, 0, start * self.group)
            completions += self.sampler.sample(state, padded, seed)[: len(chunk) * self.group]
        prompts = [p for p in self.prompts for _ in range(self.group)]
        scored = self.sampler.score(prompts, completions)
        return scored.metrics(self.sampler.rewards.names)


def _stop_ids(prompts: list[Prompt]) -> list[int]:
    return sorted({i for p in prompts for i in p.stop_ids})


def _completion(prompt: Prompt, text: str) -> Any:
    """A completion as trl hands it to reward functions: the text, or for a conversation one
    assistant message."""
    return [{"role": "assistant", "content": text}] if prompt.conversational else text
