"""The train batches of a policy-gradient run (objective=grpo): completions sampled from the
policy and scored (meshtrain.rl.sampling), laid out as rows (meshtrain.rl.rows).

A generation feeds objective.num_iterations (μ) × steps_per_generation (S) optimizer steps: at
its first step it takes the prompts of S steps, P each (meshtrain.rl.prompts), and samples
objective.num_generations (G) completions of each, all S·P·G as one batch, from the train state
as the previous step left it. The sampling key is derived from training.seed and the
generation's first step, so a resumed run samples the same completions. The advantages are
computed over the whole generation. Step i of the generation's S trains on the completions of
its own prompts (whole groups), μ times over. With μ·S > 1 the policy that sampled also scores
the completions before any update (the rows' old log-probabilities), and a checkpoint inside a
generation keeps its rows and rollout metrics (get_state), so a resumed run trains on exactly
those.

The loop hands the source the state after each step (`follow`) and then reads the next batch
ahead (`prefetch`, its time counted as data wait, within the step's wall time): the rollout
waits for the step it follows.
The record of each step gets the rollout metrics of the generation it trains on (`logged`):
trl's (meshtrain.rl.sampling.Scored.metrics), and the time split of the generation's first step:
rollout/wait_s (for the previous step's update, which it samples from), rollout/generate_s,
rollout/score_s (the rewards), rollout/old_log_probs_s (μ·S > 1), rollout/tokens_per_sec.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshtrain.config.objective import ObjectiveConfig, generation_cycle
from meshtrain.errors import ConfigError
from meshtrain.inference.decoding import generation_program
from meshtrain.models.abstract import AbstractModel, merge_model
from meshtrain.parallel.arrays import global_array
from meshtrain.rl.prompts import PromptSet
from meshtrain.rl.rows import RowLayout
from meshtrain.rl.sampling import Sampler, sampling_seed

# (params, frozen, tokens int32 [accum, rows, T]) → fp32 [accum, rows, T − 1]:
# train.objectives.policy_gradient.sampling_log_probs, compiled.
OldLogProbs = Callable[[Any, Any, jax.Array], jax.Array]


class RolloutBatches:
    """The batches of a policy-gradient run, as DeviceBatches reads a dataset's (see the module
    docstring)."""

    def __init__(
        self,
        sampler: Sampler,
        prompts: PromptSet,
        *,
        seed: int,
        sharding: NamedSharding,
        global_shape: Sequence[int],
        layout: RowLayout,
        old_log_probs: OldLogProbs | None = None,
    ) -> None:
        cfg = sampler.cfg
        self.sampler, self.prompts, self.cfg, self.seed = sampler, prompts, cfg, seed
        self._sharding, self._global_shape = sharding, tuple(global_shape)  # of rows
        self.layout = layout
        self.global_batch = prompts.per_step * cfg.num_generations
        self.cycle = generation_cycle(cfg)  # steps a generation feeds
        if self.cycle > 1 and old_log_probs is None:
            raise ValueError("a generation that feeds several steps needs old_log_probs")
        self._old_log_probs = old_log_probs
        self.step = 0  # the iterator step the next rollout is for (loop step step + 1)
        self._policy: Any = None
        self._ahead: jax.Array | None = None
        self._metrics: dict[int, dict[str, float]] = {}  # by the generation's first step
        # The rows of the generation that starts at iterator step _generation_start: int32
        # [steps_per_generation, *global_shape], on the host.
        self._generation: np.ndarray | None = None
        self._generation_start = -1

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
            self._ahead = self._batch(self.step)
            self.step += 1

    def position(self, step: int) -> int:
        """The rows before iterator step `step` (every step takes global_batch)."""
        return step * self.global_batch

    def logged(self, step: int) -> dict[str, float]:
        """Loop step `step`'s rollout metrics: those of the generation it trains on (see the
        module docstring); those of earlier generations are dropped."""
        first = step - (step - 1) % self.cycle
        for earlier in [s for s in self._metrics if s < first]:
            del self._metrics[earlier]
        return dict(self._metrics.get(first, {}))

    def get_state(self) -> dict:
        """The next step the loop takes (not the one read ahead) and, inside a generation, the
        rows it still trains on (sampled by an earlier policy, so not sampled again) and their
        rollout metrics."""
        step = self.step - (self._ahead is not None)
        if step % self.cycle == 0:
            return {"step": step}
        metrics = self._metrics.get(self._generation_start + 1, {})
        return {"step": step, "generation": self._generation, "generation_metrics": metrics}

    def set_state(self, state: dict) -> None:
        step = int(state["step"])
        self._ahead, self.step = None, step
        self._generation, self._generation_start = None, -1
        if step % self.cycle:
            generation = state.get("generation")
            shape = (self.cfg.steps_per_generation, *self._global_shape)
            if generation is None or tuple(generation.shape) != shape:
                saved = None if generation is None else list(generation.shape)
                raise ConfigError(
                    f"the checkpoint of step {step} lies inside a generation whose rows it holds "
                    f"as {saved}; this run lays a generation out as {list(shape)} (the mesh, "
                    "the batch and data.shared_prompt decide how many completions a row holds): "
                    "resume with the mesh and batch of the run that saved it, or from a "
                    "checkpoint at a generation's first step"
                )
            self._generation = np.asarray(generation)
            self._generation_start = step - step % self.cycle
            self._metrics = {self._generation_start + 1: dict(state["generation_metrics"])}

    def _batch(self, k: int) -> jax.Array:
        """Iterator step k's batch: [accum, rows, width], from its generation."""
        start = k - k % self.cycle
        if start != self._generation_start:
            self._generation, self._generation_start = self._generate(start), start
        index = (k - start) % self.cfg.steps_per_generation
        return global_array(self._generation[index], self._sharding)

    def _generate(self, start: int) -> np.ndarray:
        """The rows of the generation starting at iterator step `start`: int32
        [steps_per_generation, accum, rows, width]."""
        if self._policy is None:
            raise RuntimeError("the rollouts follow no policy: call follow(state) first")
        group, steps = self.cfg.num_generations, self.cfg.steps_per_generation
        first = start // self.cycle * steps  # the prompts' step (the generations' before it)
        unique = [p for i in range(steps) for p in self.prompts.for_step(first + i)]
        prompts = [p for p in unique for _ in range(group)]
        waiting = time.perf_counter()
        jax.block_until_ready(self._policy.params)  # the update this rollout follows
        begin = time.perf_counter()
        completions = self.sampler.sample(self._policy, unique, sampling_seed(self.seed, start + 1))
        generated = time.perf_counter()
        scored = self.sampler.score(prompts, completions)
        times = {
            "rollout/generate_s": generated - begin,
            "rollout/score_s": time.perf_counter() - generated,
        }
        trained = scored.finished | (not self.cfg.mask_truncated_completions)
        layout = self.layout
        shape = (steps, *self._global_shape[:-1])  # [steps, accum, rows]
        tokens = layout.token_rows([p.ids for p in prompts], completions, trained)
        tokens = tokens.reshape(*shape, layout.tokens)
        advantages = scored.advantages.values.reshape(*shape, layout.completions)
        lengths = np.array([c.size for c in completions])
        if self.cycle == 1:
            rows = layout.with_rollout(tokens, advantages)
        else:
            # dapo's count, per completion then per row
            share = np.sum(lengths * trained) / len(completions) * layout.completions
            scoring = time.perf_counter()
            old = self._score(tokens)
            times["rollout/old_log_probs_s"] = time.perf_counter() - scoring
            rows = layout.with_rollout(tokens, advantages, np.full(shape, share), old)
        self._metrics[start + 1] = {
            **scored.metrics(self.sampler.rewards.names),
            "rollout/wait_s": begin - waiting,
            **times,
            "rollout/tokens_per_sec": float(lengths.sum()) / max(generated - begin, 1e-9),
        }
        return rows

    def _score(self, tokens: np.ndarray) -> np.ndarray:
        """fp32 [steps_per_generation, accum, rows, T − 1]: the old log-probabilities of a
        generation's rows (tokens int32 [..., T]), under the policy that sampled them, a step's
        rows at a time."""
        state = self._policy
        return np.stack(
            [
                np.asarray(
                    self._old_log_probs(
                        state.params, state.frozen, global_array(step, self._sharding)
                    )
                )
                for step in tokens
            ]
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
        completions // cfg.num_generations,
        seq_len + 1 - cfg.max_new_tokens,
        cfg.max_new_tokens,
        vocab_size=model.config.vocab_size,
        repeats=cfg.num_generations,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
    )
