"""eval.harness inside the training loop: lm-eval harness tasks on the current parameters,
every eval.harness.every steps and at the last step. The model is the train state's own arrays
merged into a module (no export, no copy of the weights); evaluation reads them only and draws
no random key, so the training losses are those of a run without it. Every process calls it
(meshtrain.harness.run.evaluate_in_place: process 0 drives the harness)."""

from __future__ import annotations

import logging

from meshtrain.config.schema import Config
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.models.abstract import AbstractModel, merge_model
from meshtrain.train.state import TrainState

log = logging.getLogger(__name__)


class HarnessHook:
    """Knows when the harness is due and evaluates a state: {"eval/<task>/<metric>": value}."""

    def __init__(self, cfg: Config, model: AbstractModel) -> None:
        from meshtrain.harness.run import task_manager  # lm-eval: an optional extra

        self.harness, self.model = cfg.eval.harness, model
        task_manager(self.harness.tasks, self.harness.include_path)  # unknown task: one line
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.max_length = cfg.model.max_seq_len
        log.info(
            "eval.harness: %s every %s",
            ", ".join(self.harness.tasks),
            f"{self.harness.every} steps and at the last"
            if self.harness.every
            else "run, at its end",
        )

    def due(self, step: int, is_last: bool) -> bool:
        every = self.harness.every
        return is_last or (every > 0 and step % every == 0)

    def __call__(self, state: TrainState) -> dict[str, float]:
        from meshtrain.harness.run import evaluate_in_place

        net = merge_model(self.model, self.model.full_params(state.params, state.frozen))
        results = evaluate_in_place(
            net,
            self.tokenizer,
            self.harness.tasks,
            limit=self.harness.limit,
            include_path=self.harness.include_path,
            num_fewshot=self.harness.num_fewshot,
            max_length=self.max_length,
        )
        return {
            f"eval/{task}/{metric}": value
            for task, metrics in results.items()
            for metric, value in metrics.items()
        }


def harness_hook(cfg: Config, model: AbstractModel) -> HarnessHook | None:
    """The hook of eval.harness, or None where it names no task."""
    return HarnessHook(cfg, model) if cfg.eval.harness.tasks else None
