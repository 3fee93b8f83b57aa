"""`training.dry_run=true`: the real train step compiled for the mesh, no weight allocated, and
its memory plan logged and written to plan.json (docs/planning.md)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import jax

from meshtrain.config.schema import Config
from meshtrain.observe.memory_plan import MemoryPlan
from meshtrain.observe.metrics import setup_logging
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.setup import compile_train_step, describe, inspect_compiled, prepare
from meshtrain.train.state import state_shardings

log = logging.getLogger(__name__)


def dry_run(
    cfg: Config, run_dir: Path, *, devices: Sequence[jax.Device] | None = None
) -> MemoryPlan:
    """Compiles the train step on abstract inputs, allocating no weights, then logs the memory
    plan and writes plan.json (and communication.json with training.profile_communication)."""
    setup = prepare(cfg, devices, with_data=False)
    is_main = jax.process_index() == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir, is_main=is_main, rank=jax.process_index())
    describe(setup)
    with jax.set_mesh(setup.mesh):
        tx = build_optimizer(cfg.training)
        shardings = state_shardings(setup.model, tx, setup.mesh)
        # No data is read: nothing is padded, which changes neither memory nor communication.
        compiled, _ = compile_train_step(setup, tx, shardings, pad_id=-1)
        plan, _ = inspect_compiled(setup, compiled, tx, shardings, run_dir, is_main)
    log.info("dry run: plan written to %s", run_dir / "plan.json")
    return plan
