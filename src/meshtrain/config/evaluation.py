"""eval: downstream evaluation with EleutherAI's lm-eval harness inside the training loop
(docs/evaluation.md#inside-training), its keys and their start-up check. The harness model is
meshtrain.harness; the loop's hook is meshtrain.train.hooks.harness."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal, get_args

from meshtrain.errors import require

EXTRA = "eval"  # pyproject's optional dependencies that install lm-eval
HarnessOnError = Literal["stop", "warn"]
"""eval.harness.on_error."""


@dataclass
class HarnessConfig:
    """eval.harness: harness tasks evaluated on the current parameters during training."""

    tasks: list[str] = field(default_factory=list)
    """lm-eval task names (e.g. [hellaswag], or the local tasks of eval.harness.include_path); empty: none."""
    every: int = 0
    """Evaluate every this many steps, and at the last step; 0: at the last step only."""
    limit: float | None = None
    """Documents per task (a fraction when < 1); null: every document."""
    include_path: list[str] = field(default_factory=list)
    """Directories of task YAMLs besides the harness's own (e.g. examples/eval_tasks)."""
    num_fewshot: int | None = None
    """Few-shot examples per request; null: each task's own default."""
    on_error: str = "stop"  # HarnessOnError
    """An evaluation that fails (a task's template, its data): stop (one line; the checkpoint of that step is saved first) or warn (log it and train on)."""


@dataclass
class EvalConfig:
    """eval: evaluation beyond the validation loss (training.eval_every)."""

    harness: HarnessConfig = field(default_factory=HarnessConfig)
    """lm-eval harness tasks during training."""


def check_eval(cfg: EvalConfig) -> None:
    """One line for each eval.harness key that cannot work, before anything compiles (the
    tasks themselves are looked up by meshtrain.train.hooks.harness, which needs lm-eval)."""
    harness = cfg.harness
    modes = get_args(HarnessOnError)
    require(
        harness.on_error in modes,
        f"eval.harness.on_error={harness.on_error!r} is not supported; use one of: "
        + ", ".join(modes),
    )
    require(harness.every >= 0, f"eval.harness.every={harness.every} must be >= 0 (0: last step)")
    require(
        harness.limit is None or harness.limit > 0,
        f"eval.harness.limit={harness.limit} must be positive, or null for every document",
    )
    if not harness.tasks:
        return
    require(
        importlib.util.find_spec("lm_eval") is not None,
        f"eval.harness.tasks={list(harness.tasks)} needs lm-eval, which is not installed; "
        f"pip install -e '.[{EXTRA}]'",
    )
