"""The rollouts' batch source (meshtrain.rl.rollouts): a checkpoint inside a generation holds its
rows, and a run that would lay them out otherwise is refused in one line."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from meshtrain.config.objective import ObjectiveConfig
from meshtrain.errors import ConfigError
from meshtrain.rl.rollouts import RolloutBatches
from meshtrain.rl.rows import RowLayout


def _batches(rows: int, completions_per_row: int) -> RolloutBatches:
    """A source of 2 steps a generation (μ = 2), 16 completions a step in `rows` rows."""
    cfg = ObjectiveConfig(name="grpo", num_generations=4, num_iterations=2, max_new_tokens=12)
    layout = RowLayout.of(40, 12, completions_per_row, buffered=True)
    return RolloutBatches(
        SimpleNamespace(cfg=cfg),
        SimpleNamespace(per_step=4),
        seed=0,
        sharding=None,
        global_shape=(1, rows, layout.width),
        layout=layout,
        old_log_probs=lambda *args: None,
    )


def test_a_generation_saved_with_another_layout_is_refused_in_one_line():
    saved = _batches(rows=4, completions_per_row=4)  # one device: a group a row
    state = {"step": 1, "generation": np.zeros((1, 1, 4, 164), np.int32), "generation_metrics": {}}
    saved.set_state(state)  # the run that saved it resumes
    assert saved.get_state()["generation"].shape == (1, 1, 4, 164)
    with pytest.raises(ConfigError) as error:
        _batches(rows=8, completions_per_row=2).set_state(state)  # half a group a row
    message = str(error.value)
    assert "\n" not in message
    assert "step 1 lies inside a generation whose rows it holds as [1, 1, 4, 164]" in message
    assert "this run lays a generation out as [1, 1, 8, 110]" in message
