"""What the train step minimises (train.objectives.base): the next-token loss (next_token),
preference optimisation on pairs (preference) and group-relative policy optimisation on scored
completions (policy_gradient), registered by name in OBJECTIVES (objective.name)."""

from __future__ import annotations

from meshtrain.config.objective import ObjectiveConfig
from meshtrain.train.objectives.base import Objective, StepInputs
from meshtrain.train.objectives.next_token import NextToken
from meshtrain.train.objectives.policy_gradient import GroupRelative
from meshtrain.train.objectives.preference import Preference

# objective.name → its class.
OBJECTIVES: dict[str, type[Objective]] = {
    cls.name: cls for cls in (NextToken, Preference, GroupRelative)
}


def build_objective(inputs: StepInputs, cfg: ObjectiveConfig) -> Objective:
    """The objective of `cfg` for a step that reads its rows as `inputs` say."""
    return OBJECTIVES[cfg.name](inputs, cfg)


__all__ = [
    "OBJECTIVES",
    "GroupRelative",
    "NextToken",
    "Objective",
    "Preference",
    "StepInputs",
    "build_objective",
]
