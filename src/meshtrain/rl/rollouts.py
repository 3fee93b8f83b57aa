"""The train batches of a policy-gradient run (objective=grpo): each step's completions sampled
from the policy as the previous step left it, scored, and laid out as rows (meshtrain.rl.rows).

Step s takes P prompts (meshtrain.rl.prompts) and samples objective.num_generations (G)
completions of each: all P·G decode together as one batch on the training mesh
(meshtrain.inference.generate's batched program: one prefill, then decode steps on the device
until every row has stopped or objective.max_new_tokens; the prompts always padded to the width
of the longest, so one program serves the run), from the train state's own sharded
parameters (with LoRA, the base and its adapters; nothing is copied). The sampling key is derived
from training.seed and the step, so a resumed run samples the same completions. The rewards
(meshtrain.rl.rewards) and the advantages (meshtrain.rl.advantages) are computed on the host.

The loop hands the source the state after each step (`follow`) and then reads the next batch
ahead (`prefetch`, its time counted as data wait, within the step's wall time): the rollout
waits for the step it follows.
Each step's record gets trl's rollout metrics (`logged`): reward, reward_std,
frac_reward_zero_std, rewards/<function>/mean and /std, completions/mean_length, /min_length,
/max_length, /clipped_ratio (the share that reached max_new_tokens unfinished), and the time
split: rollout/wait_s (for the previous step's update, which it samples from),
rollout/generate_s, rollout/score_s, rollout/tokens_per_sec.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshtrain.config.objective import ObjectiveConfig
from meshtrain.data.tokenizer import Tokenizer
from meshtrain.inference.generate import generate_ids_batch, generation_program
from meshtrain.models.abstract import AbstractModel, merge_model
from meshtrain.rl.advantages import group_advantages, nanstd
from meshtrain.rl.prompts import Prompt, PromptSet
from meshtrain.rl.rewards import Rewards
from meshtrain.rl.rows import completion_rows, with_advantages


def sampling_seed(seed: int, step: int) -> int:
    """The sampling seed of loop step `step` (from 1) of a run with training.seed `seed`."""
    return int(np.random.default_rng([seed, step]).integers(2**31))


class RolloutBatches:
    """The batches of a policy-gradient run, as DeviceBatches reads a dataset's (see the module
    docstring)."""

    def __init__(
        self,
        model: AbstractModel,
        prompts: PromptSet,
        rewards: Rewards,
        tokenizer: Tokenizer,
        cfg: ObjectiveConfig,
        *,
        seed: int,
        sharding: NamedSharding,
        global_shape: Sequence[int],
    ) -> None:
        self.model, self.prompts, self.rewards, self.tokenizer = model, prompts, rewards, tokenizer
        self.cfg, self.seed = cfg, seed
        self._sharding, self._global_shape = sharding, tuple(global_shape)
        self.global_batch = prompts.per_step * cfg.num_generations
        self.step = 0  # the iterator step the next rollout is for (loop step step + 1)
        self._policy: Any = None
        self._ahead: jax.Array | None = None
        self._metrics: dict[int, dict[str, float]] = {}

    def follow(self, state: Any) -> None:
        """The policy the next rollouts sample from: the train state after the last step."""
        self._policy = state

    def __iter__(self) -> RolloutBatches:
        return self

    def __next__(self) -> jax.Array:
        self.prefetch()
        batch, self._ahead = self._ahead, None
        return batch

    def prefetch(self) -> None:
        if self._ahead is None:
            self._ahead = self._rollout(self.step)
            self.step += 1

    def position(self, step: int) -> int:
        """The rows before iterator step `step` (every step takes global_batch)."""
        return step * self.global_batch

    def logged(self, step: int) -> dict[str, float]:
        """Loop step `step`'s rollout metrics (see the module docstring); those of the steps
        before it, not logged, are dropped."""
        for earlier in [s for s in self._metrics if s < step]:
            del self._metrics[earlier]
        return self._metrics.pop(step, {})

    def get_state(self) -> dict:
        """The next step the loop takes (not the one read ahead)."""
        return {"step": self.step - (self._ahead is not None)}

    def set_state(self, state: dict) -> None:
        self._ahead, self.step = None, int(state["step"])

    def _rollout(self, k: int) -> jax.Array:
        """Iterator step k's batch: [accum, micro_global, seq_len + 2]."""
        if self._policy is None:
            raise RuntimeError("the rollouts follow no policy: call follow(state) first")
        group = self.cfg.num_generations
        prompts = [p for p in self.prompts.for_step(k) for _ in range(group)]
        stop_ids = sorted({i for p in prompts for i in p.stop_ids})
        waiting = time.perf_counter()
        jax.block_until_ready(self._policy.params)  # the update this rollout follows
        start = time.perf_counter()
        completions = self._sample(prompts, stop_ids, sampling_seed(self.seed, k + 1))
        generated = time.perf_counter()
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
        advantages = group_advantages(self.rewards.total(scores), group, self.cfg.scale_rewards)
        scored = time.perf_counter()
        trained = finished | (not self.cfg.mask_truncated_completions)
        rows = completion_rows(
            [p.ids for p in prompts], completions, trained, self._global_shape[-1] - 1
        )
        rows = with_advantages(rows, advantages.values).reshape(self._global_shape)
        lengths = np.array([c.size for c in completions])
        self._metrics[k + 1] = {
            "reward": advantages.reward,
            "reward_std": advantages.reward_std,
            "frac_reward_zero_std": advantages.frac_reward_zero_std,
            **{
                metric: value
                for j, name in enumerate(self.rewards.names)
                for metric, value in (
                    (f"rewards/{name}/mean", float(np.nanmean(scores[:, j]))),
                    (f"rewards/{name}/std", float(nanstd(scores[:, j]))),
                )
            },
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(np.mean(~finished)),
            "rollout/wait_s": start - waiting,
            "rollout/generate_s": generated - start,
            "rollout/score_s": scored - generated,
            "rollout/tokens_per_sec": float(lengths.sum()) / max(generated - start, 1e-9),
        }
        return jax.device_put(rows, self._sharding)

    def _sample(self, prompts: list[Prompt], stop_ids: list[int], seed: int) -> list[np.ndarray]:
        """Each prompt's completion, sampled from the followed policy (int32 [≤ max_new_tokens],
        with the stop id that ended it, if one did)."""
        state, cfg = self._policy, self.cfg
        net = merge_model(self.model, self.model.full_params(state.params, state.frozen))
        return generate_ids_batch(
            net,
            [p.ids for p in prompts],
            cfg.max_new_tokens,
            cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            stop_ids=stop_ids,
            vocab_size=min(self.tokenizer.vocab_size, self.model.config.vocab_size),
            seed=seed,
            bucket=self.prompts.width,
        )


def rollout_program(
    model: AbstractModel, state: Any, cfg: ObjectiveConfig, *, completions: int, seq_len: int
) -> jax.stages.Lowered:
    """The sampling program of a step's `completions` from the train state `state` (abstract:
    ShapeDtypeStructs with their shardings), its prompts padded to the most a row of seq_len + 1
    tokens leaves them beside objective.max_new_tokens, lowered (the dry run compiles it, before
    the prompts are read). Run it under the mesh."""
    policy = merge_model(model, model.full_params(state.params, state.frozen))
    return generation_program(
        policy,
        completions,
        seq_len + 1 - cfg.max_new_tokens,
        cfg.max_new_tokens,
        vocab_size=model.config.vocab_size,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
    )


def _completion(prompt: Prompt, text: str) -> Any:
    """A completion as trl hands it to reward functions: the text, or for a conversation one
    assistant message."""
    return [{"role": "assistant", "content": text}] if prompt.conversational else text
