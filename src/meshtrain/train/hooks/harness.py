"""eval.harness inside the training loop: lm-eval harness tasks on the current parameters,
every eval.harness.every steps and at the last step. The model is the train state's own arrays
merged into a module (no export, no copy of the weights); evaluation reads them only and draws
no random key, so the training losses are those of a run without it. Every process calls it
(meshtrain.harness.run.evaluate_in_place: process 0 drives the harness).

An evaluation that fails (a task whose template names a missing field, data it cannot read)
costs no training state: the checkpoint due at that step is saved all the same (HookRunner runs
the save after a failing evaluation). With
eval.harness.on_error=stop it ends the run in one line naming the task list and the error; with
warn it is logged and training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from meshtrain.config.schema import Config
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import ConfigError
from meshtrain.models.abstract import AbstractModel, merge_model
from meshtrain.train.hooks.base import Cadence, StepInfo

log = logging.getLogger(__name__)


class HarnessTasks:
    """The hook: {"eval/<task>/<metric>": value} of the state after a due step."""

    name = "lm-eval harness"
    part_of_step = False

    def __init__(self, cfg: Config, model: AbstractModel) -> None:
        from meshtrain.harness.run import task_manager  # lm-eval: an optional extra

        self.harness, self.model = cfg.eval.harness, model
        task_manager(self.harness.tasks, self.harness.include_path)  # (checked at start-up)
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.max_length = cfg.model.max_seq_len
        self.cadence = Cadence(every=self.harness.every, last=True)
        every = self.harness.every
        when = f"every {every} steps and at the last step" if every else "at the last step"
        log.info("eval.harness: %s %s", ", ".join(self.harness.tasks), when)

    def __call__(self, info: StepInfo) -> Mapping[str, float]:
        from meshtrain.harness.run import evaluate_in_place

        state = info.state
        net = merge_model(self.model, self.model.full_params(state.params, state.frozen))
        try:
            results = evaluate_in_place(
                net,
                self.tokenizer,
                self.harness.tasks,
                limit=self.harness.limit,
                include_path=self.harness.include_path,
                num_fewshot=self.harness.num_fewshot,
                max_length=self.max_length,
            )
        except Exception as err:  # a task's own failure: lm-eval, jinja, its data
            message = (
                f"eval.harness at step {info.step} failed on tasks "
                f"{', '.join(self.harness.tasks)}: {type(err).__name__}: "
                f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            )
            if self.harness.on_error == "warn":
                log.warning("%s; training goes on (eval.harness.on_error=warn)", message)
                return {}
            raise ConfigError(
                f"{message}; the checkpoint of step {info.step} is saved where one was due. "
                "Fix the task, or set eval.harness.on_error=warn to train on"
            ) from err
        return {
            f"eval/{task}/{metric}": value
            for task, metrics in results.items()
            for metric, value in metrics.items()
        }


def harness_tasks(cfg: Config, model: AbstractModel) -> HarnessTasks | None:
    """The hook of eval.harness, or None where it names no task."""
    return HarnessTasks(cfg, model) if cfg.eval.harness.tasks else None
