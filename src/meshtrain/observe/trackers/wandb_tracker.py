"""The Weights & Biases tracker (logging.trackers=[..., wandb]): one W&B run per launch, with the
resolved config, each logged step's metrics at its step, and the run's name.

W&B's own environment applies where logging.wandb leaves a key null: WANDB_PROJECT,
WANDB_ENTITY, WANDB_MODE (offline: the run is written under <run_dir>/wandb/, or under
$WANDB_DIR/wandb/ when the user set it, and `wandb sync` uploads it later), WANDB_API_KEY. A resumed run is a new W&B run of the same name that starts
at the resumed step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import wandb

from meshtrain.config.trackers import WandbConfig
from meshtrain.observe.trackers.run_info import RunInfo

log = logging.getLogger(__name__)

DEFAULT_PROJECT = "meshtrain"


def project_name(settings: WandbConfig, environ: Mapping[str, str] | None = None) -> str:
    """logging.wandb.project, else $WANDB_PROJECT, else "meshtrain"."""
    environ = os.environ if environ is None else environ
    return settings.project or environ.get("WANDB_PROJECT") or DEFAULT_PROJECT


def run_files_dir(run_dir: os.PathLike, environ: Mapping[str, str] | None = None) -> str:
    """Where W&B writes the run's files: $WANDB_DIR when set (W&B's own rule), else the run
    directory."""
    environ = os.environ if environ is None else environ
    return environ.get("WANDB_DIR") or str(run_dir)


class WandbTracker:
    """A W&B run in the run directory; its metrics under the names every tracker uses."""

    def __init__(self, settings: WandbConfig, run: RunInfo) -> None:
        self._run = wandb.init(
            project=project_name(settings),
            entity=settings.entity,  # None: $WANDB_ENTITY, else the account's default
            name=settings.name or run.name,
            tags=list(settings.tags) or None,
            mode=settings.mode,  # None: $WANDB_MODE, else online
            dir=run_files_dir(run.run_dir),
            config=run.config,
            reinit="create_new",  # a second run in this process (a sweep) gets its own
            # meshtrain's log is its console (W&B's copy of it would print every line twice),
            # and the line below says where the run went.
            settings=wandb.Settings(console="off", silent=True),
        )
        mode = self._run.settings.mode
        if mode == "offline":
            where = self._run.settings.sync_dir
            log.info("W&B: offline run %s in %s (`wandb sync` it to upload)", run.name, where)
        elif mode != "disabled":
            log.info("W&B: run %s at %s", self._run.name, self._run.url)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self, *, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)
