"""objective: what the train step minimises (configs/objective/, meshtrain.train.objectives), its
keys and their start-up check (docs/preference.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from meshtrain.errors import require

ObjectiveName = Literal["lm", "dpo"]
"""objective.name: lm (the next-token loss: pretraining, SFT) or dpo (preference pairs)."""
PreferenceLoss = Literal["sigmoid", "ipo", "hinge", "robust", "simpo"]
"""objective.loss_type of dpo."""
Reference = Literal["initial", "none"]
"""objective.reference of dpo."""
REFERENCE_FREE: tuple[str, ...] = ("simpo",)


@dataclass
class ObjectiveConfig:
    """objective: the loss of the train step and its keys."""

    name: str = "lm"  # ObjectiveName
    """lm: the next-token loss on the targets that carry loss (pretraining, SFT); dpo: a preference loss on pairs of answers (data=preference)."""
    loss_type: str = "sigmoid"  # PreferenceLoss
    """dpo: sigmoid (DPO), ipo (IPO, length-normalised), hinge (SLiC), robust (rDPO, with label_smoothing) or simpo (SimPO: reference-free, length-normalised, with gamma); grpo (train.objectives.policy_gradient): grpo, dr_grpo or dapo, how the per-token losses are averaged."""
    beta: float = 0.1
    """dpo: the strength of the preference against the reference (SimPO: the reward scale), > 0; grpo: the weight of the per-token KL to the reference, >= 0."""
    label_smoothing: float = 0.0
    """dpo: the share of pairs assumed flipped, in [0, 0.5): conservative DPO with sigmoid, robust DPO with robust, and SimPO's."""
    gamma: float = 0.5
    """dpo, simpo: SimPO's target reward margin (trl's simpo_gamma)."""
    reference: str = "initial"  # Reference
    """dpo, grpo: the model the policy is measured against: initial (a frozen copy of the starting weights; with LoRA, the base with the adapters off) or none (simpo; grpo with beta=0)."""
    epsilon: float = 0.2
    """grpo: the clipping range of the policy ratio below 1 (PPO's ε); > 0."""
    epsilon_high: float | None = None
    """grpo: the clipping range above 1 (DAPO's clip-higher); null: epsilon."""
    max_new_tokens: int = 256
    """grpo: the most tokens a sampled completion has (dr_grpo divides by it)."""


def reads_reference(cfg: ObjectiveConfig) -> bool:
    """Whether the objective measures the policy against a reference model."""
    return cfg.name in ("dpo", "grpo") and cfg.reference != "none"


def check_objective(cfg: ObjectiveConfig, *, data_source: str, document_masking: bool) -> None:
    """One line for each objective key that cannot work, before anything compiles."""
    names = get_args(ObjectiveName)
    require(
        cfg.name in names,
        f"objective.name={cfg.name!r} is not supported; use one of: {', '.join(names)}",
    )
    if cfg.name != "dpo":
        return
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
    references = get_args(Reference)
    require(
        cfg.reference in references,
        f"objective.reference={cfg.reference!r} is not supported; use one of: "
        f"{', '.join(references)}",
    )
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
