"""objective: what the train step minimises (configs/objective/, meshtrain.train.objectives), its
keys and their start-up check (docs/preference.md, docs/rl.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from meshtrain.errors import require

if TYPE_CHECKING:  # the schema imports this module
    from meshtrain.config.schema import DataConfig, ModelConfig

ObjectiveName = Literal["lm", "dpo", "grpo"]
"""objective.name: lm (the next-token loss: pretraining, SFT), dpo (preference pairs) or grpo
(group-relative policy optimisation on scored completions)."""
PreferenceLoss = Literal["sigmoid", "ipo", "hinge", "robust", "simpo"]
"""objective.loss_type of dpo."""
PolicyLoss = Literal["grpo", "dr_grpo", "dapo"]
"""objective.loss_type of grpo: how the per-token losses are averaged."""
ImportanceSampling = Literal["token", "sequence"]
"""objective.importance_sampling_level of grpo."""
RewardScaling = Literal["group", "batch", "none"]
"""objective.scale_rewards of grpo."""
Reference = Literal["initial", "precomputed", "none"]
"""objective.reference of dpo and grpo (precomputed: dpo only)."""
REFERENCE_FREE: tuple[str, ...] = ("simpo",)


@dataclass
class ObjectiveConfig:
    """objective: the loss of the train step and its keys."""

    name: str = "lm"  # ObjectiveName
    """lm: the next-token loss on the targets that carry loss (pretraining, SFT); dpo: a preference loss on pairs of answers (data=preference); grpo: a policy-gradient loss on scored completions."""
    loss_type: str = "sigmoid"  # PreferenceLoss | PolicyLoss
    """dpo: sigmoid (DPO), ipo (IPO, length-normalised), hinge (SLiC), robust (rDPO, with label_smoothing) or simpo (SimPO: reference-free, length-normalised, with gamma); grpo: grpo (each completion's mean over its tokens, then the mean over completions), dr_grpo (the sum over completion tokens over completions × max_new_tokens) or dapo (the mean over every completion token of the update)."""
    beta: float = 0.1
    """dpo: the strength of the preference against the reference (SimPO: the reward scale), > 0; grpo: the weight of the per-token KL to the reference, ≥ 0 (0: no reference is read)."""
    label_smoothing: float = 0.0
    """dpo: the share of pairs assumed flipped, in [0, 0.5): conservative DPO with sigmoid, robust DPO with robust, and SimPO's."""
    gamma: float = 0.5
    """dpo, simpo: SimPO's target reward margin (trl's simpo_gamma)."""
    reference: str = "initial"  # Reference
    """dpo, grpo: the model the policy is measured against: initial (a frozen copy of the starting weights; with LoRA, the base with the adapters off), precomputed (dpo: that model scores every pair once before training, its log-probabilities are kept beside the data's cache and the step runs the policy alone) or none (simpo; grpo with beta=0)."""
    epsilon: float = 0.2
    """grpo: the clipping range of the policy ratio below 1 (PPO's ε); > 0."""
    epsilon_high: float | None = None
    """grpo: the clipping range above 1 (DAPO's clip-higher); null: epsilon."""
    num_generations: int = 8
    """grpo: the completions sampled per prompt (G, one group); training.global_batch_size counts completions and must be a multiple of it."""
    max_new_tokens: int = 256
    """grpo: the most tokens a completion has; one that reaches it unfinished is truncated (completions/clipped_ratio); dr_grpo divides by it."""
    temperature: float = 1.0
    """grpo: the sampling temperature of the rollouts; > 0 (a group of greedy completions would be one completion G times)."""
    top_k: int = 0
    """grpo: sample among the k most likely tokens only; 0: all."""
    top_p: float = 1.0
    """grpo: sample among the most likely tokens whose probabilities add up to top_p; in (0, 1]."""
    rewards: list[str] = field(default_factory=list)
    """grpo: the reward functions, each "module:function" or "path/to/file.py:function", called as trl calls them: function(prompts=[...], completions=[...], completion_ids=[...], **the records' other columns) → one float (or None) per completion (docs/rl.md); or a built-in: exact_match (the completion's answer against answer_column), format_match (the completion against format_pattern)."""
    answer_column: str = "answer"
    """grpo, exact_match: the records' column holding each prompt's answer."""
    answer_pattern: str | None = None
    """grpo, exact_match: a regular expression that finds the answer in a completion (its first group, or its whole match); null: the whole completion, stripped."""
    format_pattern: str | None = None
    """grpo, format_match: the regular expression a whole completion must match (`.` matches newlines)."""
    reward_weights: list[float] = field(default_factory=list)
    """grpo: each reward function's weight in the summed reward; empty: all 1."""
    scale_rewards: str = "group"  # RewardScaling
    """grpo: divide each advantage by its group's reward std (group), the whole batch's (batch), or not at all (none: Dr. GRPO)."""
    mask_truncated_completions: bool = False
    """grpo: completions that reach max_new_tokens unfinished carry no loss (DAPO)."""
    num_iterations: int = 1
    """grpo: the updates on each generation's completions (GRPO's μ); above 1, the ratio to the sampling policy moves away from 1 and the clip acts."""
    steps_per_generation: int = 1
    """grpo: the optimizer steps one generation feeds: it samples the prompts of that many steps at once, and step i of the generation trains on the completions of its own prompts (whole groups)."""
    importance_sampling_level: str = "token"  # ImportanceSampling
    """grpo: the policy ratio per token (token: GRPO) or one per completion, the exponential of its tokens' mean log-ratio (sequence: GSPO)."""


def generation_cycle(cfg: ObjectiveConfig) -> int:
    """The optimizer steps between two generations of a grpo run (μ × steps_per_generation);
    above 1 the rows carry the sampling policy's log-probabilities (meshtrain.rl.rows)."""
    return cfg.num_iterations * cfg.steps_per_generation


def reads_reference(cfg: ObjectiveConfig) -> bool:
    """Whether the objective measures the policy against a reference model."""
    return cfg.name in ("dpo", "grpo") and cfg.reference != "none"


def precomputed_reference(cfg: ObjectiveConfig) -> bool:
    """Whether the reference's log-probabilities are computed once before training and read
    from the batch (objective.reference=precomputed), not computed in the step."""
    return reads_reference(cfg) and cfg.reference == "precomputed"


def check_objective(cfg: ObjectiveConfig, *, data_source: str, document_masking: bool) -> None:
    """One line for each objective key that cannot work, before anything compiles."""
    names = get_args(ObjectiveName)
    require(
        cfg.name in names,
        f"objective.name={cfg.name!r} is not supported; use one of: {', '.join(names)}",
    )
    require(
        data_source != "prompts" or cfg.name == "grpo",
        f"data=prompts holds prompts to sample completions from, which objective={cfg.name} "
        "does not do: set objective=grpo",
    )
    if cfg.name == "dpo":
        _check_dpo(cfg, data_source=data_source, document_masking=document_masking)
    elif cfg.name == "grpo":
        _check_grpo(cfg, data_source=data_source)


def _check_reference(cfg: ObjectiveConfig) -> None:
    references = get_args(Reference)
    require(
        cfg.reference in references,
        f"objective.reference={cfg.reference!r} is not supported; use one of: "
        f"{', '.join(references)}",
    )


def _check_dpo(cfg: ObjectiveConfig, *, data_source: str, document_masking: bool) -> None:
    require(
        data_source == "preference",
        f"objective=dpo trains on pairs of answers: set data=preference (data.source="
        f"{data_source!r} holds no pairs)",
    )
    require(
        document_masking,
        "objective=dpo reads each pair's answers as documents: set data.document_masking=true",
    )
    losses = get_args(PreferenceLoss)
    require(
        cfg.loss_type in losses,
        f"objective.loss_type={cfg.loss_type!r} is not supported; use one of: {', '.join(losses)}",
    )
    require(cfg.beta > 0, f"objective.beta={cfg.beta} must be > 0")
    require(
        0 <= cfg.label_smoothing < 0.5,
        f"objective.label_smoothing={cfg.label_smoothing} must be in [0, 0.5)",
    )
    _check_reference(cfg)
    if cfg.loss_type in REFERENCE_FREE:
        require(
            cfg.reference == "none",
            f"objective.loss_type={cfg.loss_type} is reference-free: set objective.reference=none",
        )
    else:
        require(
            cfg.reference != "none",
            f"objective.loss_type={cfg.loss_type} measures the policy against a reference: set "
            "objective.reference=initial (or objective.loss_type=simpo, which needs none)",
        )
    require(
        cfg.label_smoothing == 0 or cfg.loss_type in ("sigmoid", "robust", "simpo"),
        f"objective.label_smoothing={cfg.label_smoothing} applies to sigmoid, robust and simpo, "
        f"not {cfg.loss_type}; set it to 0",
    )


def _check_grpo(cfg: ObjectiveConfig, *, data_source: str) -> None:
    require(
        data_source == "prompts",
        f"objective=grpo samples its completions from prompts: set data=prompts (data.source="
        f"{data_source!r})",
    )
    losses = get_args(PolicyLoss)
    require(
        cfg.loss_type in losses,
        f"objective.loss_type={cfg.loss_type!r} is not a grpo loss; use one of: "
        f"{', '.join(losses)}",
    )
    require(cfg.beta >= 0, f"objective.beta={cfg.beta} must be >= 0")
    _check_reference(cfg)
    require(
        cfg.reference != "precomputed",
        "objective.reference=precomputed scores fixed pairs before training; grpo's completions "
        "are sampled as it trains: set objective.reference=initial",
    )
    if cfg.beta > 0:
        require(
            cfg.reference != "none",
            f"objective.beta={cfg.beta} weighs the KL to a reference: set "
            "objective.reference=initial (or objective.beta=0)",
        )
    else:
        require(
            cfg.reference == "none",
            "objective.beta=0 reads no reference: set objective.reference=none (or "
            "objective.beta > 0)",
        )
    require(cfg.epsilon > 0, f"objective.epsilon={cfg.epsilon} must be > 0")
    require(
        cfg.epsilon_high is None or cfg.epsilon_high > 0,
        f"objective.epsilon_high={cfg.epsilon_high} must be > 0 (or null: objective.epsilon)",
    )
    require(
        cfg.num_generations >= 2,
        f"objective.num_generations={cfg.num_generations} must be >= 2: advantages compare "
        "the completions of one prompt",
    )
    require(cfg.max_new_tokens >= 1, f"objective.max_new_tokens={cfg.max_new_tokens} must be >= 1")
    require(
        cfg.temperature > 0,
        f"objective.temperature={cfg.temperature} must be > 0: greedy completions of one prompt "
        "are all the same",
    )
    require(cfg.top_k >= 0, f"objective.top_k={cfg.top_k} must be >= 0 (0: all tokens)")
    require(0 < cfg.top_p <= 1, f"objective.top_p={cfg.top_p} must be in (0, 1]")
    require(
        len(cfg.rewards) > 0,
        "objective.rewards is empty: name at least one reward function, e.g. "
        "'objective.rewards=[examples/rl/rewards.py:correct_sum]'",
    )
    require(
        not cfg.reward_weights or len(cfg.reward_weights) == len(cfg.rewards),
        f"objective.reward_weights has {len(cfg.reward_weights)} weights for "
        f"{len(cfg.rewards)} reward functions: give one per function (or none: all 1)",
    )
    require(
        cfg.num_iterations >= 1,
        f"objective.num_iterations={cfg.num_iterations} must be >= 1 (updates per generation)",
    )
    require(
        cfg.steps_per_generation >= 1,
        f"objective.steps_per_generation={cfg.steps_per_generation} must be >= 1",
    )
    levels = get_args(ImportanceSampling)
    require(
        cfg.importance_sampling_level in levels,
        f"objective.importance_sampling_level={cfg.importance_sampling_level!r} is not "
        f"supported; use one of: {', '.join(levels)}",
    )
    scalings = get_args(RewardScaling)
    require(
        cfg.scale_rewards in scalings,
        f"objective.scale_rewards={cfg.scale_rewards!r} is not supported; use one of: "
        f"{', '.join(scalings)}",
    )


def check_shared_prompt(model: ModelConfig, data: DataConfig) -> None:
    """A pair's rejected answer sits after its chosen one in the sequence (data.shared_prompt):
    attention must reach across the chosen answer to the prompt, which a sliding window shorter
    than the sequence would cut."""
    if (
        data.source != "preference"
        or not data.shared_prompt
        or "local" not in model.attention_pattern
    ):
        return
    window = model.sliding_window
    require(
        window is None or window >= data.seq_len,
        f"data.shared_prompt=true packs a pair's rejected answer after its chosen one, so its "
        f"prompt can lie beyond model.sliding_window={window} in sequences of data.seq_len="
        f"{data.seq_len}: set data.shared_prompt=false (the prompt once per answer), or "
        f"data.seq_len<={window}",
    )
