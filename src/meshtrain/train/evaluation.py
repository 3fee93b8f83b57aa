"""The validation metrics: the objective's loss and metrics over fixed held-out batches, placed on
the devices once (the next-token loss: averaged over the tokens that carry loss; for chat data,
the trained tokens only)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from meshtrain.data import validation_batches
from meshtrain.train.batch import process_rows, to_global_array
from meshtrain.train.setup import Setup
from meshtrain.train.state import TrainState
from meshtrain.train.step import make_eval_step


def make_evaluator(
    setup: Setup, shardings: TrainState
) -> Callable[[TrainState], dict[str, float]] | None:
    """A function state → the objective's metrics of its parameters over the fixed validation
    batches ("loss" first), or None when eval is off."""
    cfg = setup.cfg
    if setup.validation_data is None:
        return None
    eval_shape = setup.batch_shape[1:]  # a micro-batch: [batch, seq_len + 1 + extra columns]
    eval_sharding = setup.rows_sharding
    local = validation_batches(
        setup.validation_data,
        global_batch=setup.micro_global,
        num_batches=cfg.training.eval_batches,
        rows=process_rows(eval_sharding, eval_shape, axis=0),
    )
    device_batches = [to_global_array(b, eval_sharding, eval_shape) for b in local]
    objective = setup.objective
    eval_step = make_eval_step(
        setup.model, state_shardings=shardings, batch_sharding=eval_sharding, objective=objective
    )

    def evaluate(state: TrainState) -> dict[str, float]:
        sums = [eval_step(state.params, state.frozen, batch) for batch in device_batches]
        # Added up on the host in float64, then the objective's metrics of the whole split.
        fetched = jax.device_get(sums)
        names = list(fetched[0])
        table = np.asarray([[batch[n] for n in names] for batch in fetched], dtype=np.float64)
        total = dict(zip(names, np.sum(table, axis=0), strict=True))
        total["count"] = max(total["count"], 1.0)
        return {name: float(value) for name, value in objective.metrics(total).items()}

    return evaluate
