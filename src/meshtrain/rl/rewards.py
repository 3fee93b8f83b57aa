"""The reward functions of objective.rewards, loaded at start-up and called as trl's GRPOTrainer
calls its reward functions.

Each is named "module:function" (an importable module), "path/to/file.py:function" or, for the
built-ins (meshtrain.rl.builtin_rewards), by its name alone (exact_match, format_match), and called
once per step with keyword arguments: prompts (each completion's prompt as the record wrote it: a
string, or a list of messages), completions (the sampled text: a string, or for a list-of-messages
prompt [{"role": "assistant", "content": text}]), completion_ids (each completion's token ids,
with the stop token that ended it, as trl passes them) and every other column of the prompts'
records, one value per completion. It returns one float per completion, or None where it does
not apply. A completion's reward is the weighted sum (objective.reward_weights) of the functions
that scored it; nan where none did (its advantage is then 0, meshtrain.rl.advantages). A function
that raises or returns the wrong number of rewards stops the run with one line naming it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshtrain.config.objective import ObjectiveConfig
from meshtrain.errors import ConfigError, first_line
from meshtrain.rl.builtin_rewards import BUILTIN_REWARDS, builtin_reward


def load_reward_function(
    spec: str, key: str, cfg: ObjectiveConfig | None = None
) -> Callable[..., Sequence[float | None]]:
    """The function `spec` names ("module:function", "file.py:function" or a built-in's name,
    bound to the keys of `cfg`); `key`: the config key it came from, for the one-line error."""
    if spec in BUILTIN_REWARDS:
        return builtin_reward(spec, cfg or ObjectiveConfig(name="grpo"))
    where, _, name = spec.rpartition(":")
    hint = (
        f"give 'module:function', 'path/to/file.py:function' or a built-in "
        f"({', '.join(BUILTIN_REWARDS)})"
    )
    if not where or not name:
        raise ConfigError(f"{key}={spec!r} names no function; {hint}")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(f"{key}={spec!r}: {path} is not a file; {hint}")
            module_spec = importlib.util.spec_from_file_location(
                f"_meshtrain_rewards_{path.stem}", path
            )
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as err:  # the user's module failed to import: say which and why
        raise ConfigError(
            f"{key}={spec!r}: importing {where} failed ({type(err).__name__}: {err})"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"{key}={spec!r}: {where} has no function {name!r}; {hint}")
    return function


class Rewards:
    """The reward functions of a run and their weights (see the module docstring)."""

    def __init__(
        self,
        specs: Sequence[str],
        weights: Sequence[float] = (),
        cfg: ObjectiveConfig | None = None,
    ) -> None:
        self.functions = [
            load_reward_function(spec, f"objective.rewards[{i}]", cfg)
            for i, spec in enumerate(specs)
        ]
        self.names = [
            getattr(f, "__name__", spec) for f, spec in zip(self.functions, specs, strict=True)
        ]
        self.weights = np.asarray(weights or [1.0] * len(specs), np.float64)

    def score(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        columns: list[dict[str, Any]],
    ) -> np.ndarray:
        """float64 [N, functions]: each function's reward of each completion (nan: None)."""
        count = len(completions)
        extra = {key: [c.get(key) for c in columns] for key in columns[0]} if columns else {}
        scores = np.full((count, len(self.functions)), np.nan)
        for j, (function, name) in enumerate(zip(self.functions, self.names, strict=True)):
            try:
                values = list(
                    function(
                        prompts=prompts,
                        completions=completions,
                        completion_ids=completion_ids,
                        **extra,
                    )
                )
            except Exception as err:  # the user's function: named, in one line
                raise ConfigError(
                    f"reward function {name} (objective.rewards[{j}]) raised "
                    f"{type(err).__name__}: {first_line(err)}"
                ) from err
            if len(values) != count:
                raise ConfigError(
                    f"reward function {name} (objective.rewards[{j}]) returned {len(values)} "
                    f"rewards for {count} completions; return one float (or None) per completion"
                )
            scores[:, j] = [np.nan if v is None else float(v) for v in values]
        return scores

    def total(self, scores: np.ndarray) -> np.ndarray:
        """[N]: the weighted sum of each completion's rewards, nan where no function scored it."""
        summed = np.nansum(scores * self.weights, axis=1)
        return np.where(np.all(np.isnan(scores), axis=1), np.nan, summed)
