"""The weights a start of a run reads before it trains, each read at most once: the frozen LoRA
base, or the starting parameters (checkpoint.load_params, model.init_from, else the seed's
random draw), which serve a fresh policy, a reference copy (objective.reference=initial) and the
reference that scores the pairs before training (objective.reference=precomputed) alike."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from meshtrain.models.initialization import initial_params
from meshtrain.observe.progress import phase
from meshtrain.train.setup import Setup
from meshtrain.train.state import TrainState, init_compiler_options
from meshtrain.weights.initial_weights import load_initial_params
from meshtrain.weights.lora_base import load_frozen_base

log = logging.getLogger(__name__)


class StartingWeights:
    """The start's weights for `setup`, read on first use and kept: `base()` (the frozen LoRA
    base), `params()` (the starting parameters, in their shardings), `reference()` (what a
    precomputed reference scores with: the base, else the parameters) and `policy()` (a fresh
    state's parameters)."""

    def __init__(self, setup: Setup, shardings: TrainState, checkpoint_dir_of_run: Path) -> None:
        self.setup, self.shardings, self.run_checkpoints = setup, shardings, checkpoint_dir_of_run
        self._base: Any = None
        self._params: Any = None

    def base(self) -> Any:
        if self._base is None:
            with phase(log, "reading the frozen LoRA base", "read the frozen LoRA base"):
                self._base = load_frozen_base(
                    self.setup.cfg, self.setup.model, checkpoint_dir_of_run=self.run_checkpoints
                )
        return self._base

    def params(self) -> Any:
        if self._params is None:
            with phase(log, "reading the starting weights", "read the starting weights"):
                self._params = self._read_params()
        return self._params

    def reference(self) -> Any:
        return self.base() if self.setup.model.lora else self.params()

    def policy(self) -> Any:
        """A fresh state's parameters: those already read (a copy, where a reference copy keeps
        them: the step donates the policy's arrays), else read now, or None where the state draws
        them itself from the seed (create_train_state: the same draw)."""
        if self._params is None:
            cfg = self.setup.cfg
            return load_initial_params(
                cfg, self.setup.model, checkpoint_dir_of_run=self.run_checkpoints
            )
        params = self._params
        if self.setup.reference_copy:
            return jax.tree.map(jnp.copy, params)
        self._params = None  # handed over: the state owns them now
        return params

    def _read_params(self) -> Any:
        cfg, model = self.setup.cfg, self.setup.model
        params = load_initial_params(cfg, model, checkpoint_dir_of_run=self.run_checkpoints)
        if params is None:
            options = init_compiler_options(self.shardings)
            params = initial_params(cfg.model, cfg.training.seed, self.shardings.params, options)
        return params
