"""What runs after each train step, as hooks with a cadence (train.hooks.base): the step's
metrics, the non-finite guard, the checkpoint, the validation loss, the lm-eval harness and the
profiler window. `train.loop` builds them in order and runs the due ones after every step."""

from meshtrain.train.hooks.base import AnyOf, Cadence, Hook, HookRunner, StepInfo

__all__ = ["AnyOf", "Cadence", "Hook", "HookRunner", "StepInfo"]
