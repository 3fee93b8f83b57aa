"""What the train step minimises (train.objectives.base): the next-token loss (next_token), and
the objectives that register beside it in OBJECTIVES."""

from __future__ import annotations

from meshtrain.train.objectives.base import Objective, StepInputs
from meshtrain.train.objectives.next_token import NextToken

# objective name → its class.
OBJECTIVES: dict[str, type[Objective]] = {NextToken.name: NextToken}


def build_objective(inputs: StepInputs, name: str = NextToken.name) -> Objective:
    """The objective `name` for a step that reads its rows as `inputs` say."""
    return OBJECTIVES[name](inputs)


__all__ = ["OBJECTIVES", "NextToken", "Objective", "StepInputs", "build_objective"]
