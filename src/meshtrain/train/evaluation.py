"""The validation loss: fixed held-out batches, placed on the devices once, averaged over the
tokens that carry loss (for chat data, the trained tokens only)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshtrain.data import validation_batches
from meshtrain.parallel.rules import logical_to_spec
from meshtrain.train.batch import process_rows, to_global_array
from meshtrain.train.setup import Setup
from meshtrain.train.state import TrainState
from meshtrain.train.step import make_eval_step


def make_evaluator(setup: Setup, shardings: TrainState) -> Callable[[TrainState], float] | None:
    """A function state → mean validation loss of its parameters over fixed batches, or None
    when eval is off."""
    cfg = setup.cfg
    if setup.validation_data is None:
        return None
    eval_shape = (setup.micro_global, cfg.data.seq_len + 1)  # [batch, seq_len + 1]
    eval_sharding = NamedSharding(
        setup.mesh, logical_to_spec(("batch", None), cfg.model.logical_axis_rules)
    )
    local = validation_batches(
        setup.validation_data,
        global_batch=setup.micro_global,
        num_batches=cfg.training.eval_batches,
        rows=process_rows(eval_sharding, eval_shape, axis=0),
    )
    device_batches = [to_global_array(b, eval_sharding, eval_shape) for b in local]
    eval_step = make_eval_step(
        setup.model,
        state_shardings=shardings,
        batch_sharding=eval_sharding,
        token_format=setup.token_format,
        mixed_precision=cfg.training.mixed_precision,
        pipeline=setup.pipeline,
    )

    def evaluate(state: TrainState) -> float:
        sums = [eval_step(state.params, state.frozen, batch) for batch in device_batches]
        loss_sum, count = np.sum(np.asarray(jax.device_get(sums), dtype=np.float64), axis=0)
        return float(loss_sum / max(count, 1.0))

    return evaluate
