"""The TensorBoard tracker: each logged step's scalars, and the run's config as a text table, in
an events file of the run directory (`tensorboard --logdir outputs/`)."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from meshtrain.observe.trackers.run_info import RunInfo, flat_config

if TYPE_CHECKING:
    from tensorboardX import SummaryWriter

_writer_numbers = itertools.count()


def import_summary_writer() -> type[SummaryWriter]:
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX imports torch when it is installed (1.4 s of every launch on a 2-core machine)
    only to accept torch tensors; meshtrain logs floats. Unless torch is loaded already, it is
    hidden while tensorboardX loads, and its functions that need torch import it themselves.
    """
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return SummaryWriter


def config_table(config: Mapping[str, object]) -> str:
    """The config as a Markdown table of key and value (TensorBoard's text tab renders it)."""
    rows = [f"| `{key}` | `{value}` |" for key, value in flat_config(config).items()]
    return "\n".join(["| key | value |", "|---|---|", *rows])


class TensorBoardTracker:
    """Scalars `train/<metric>` and `val/<metric>`; a resumed run's events from its start step
    on replace the earlier attempt's (TensorBoard purges them)."""

    def __init__(self, run: RunInfo) -> None:
        # tensorboardX names its file by the second and the host and truncates a file of that
        # name: the pid and a per-process count keep a second writer from erasing the first's.
        self._writer = import_summary_writer()(
            logdir=str(run.run_dir),
            purge_step=run.start_step + 1,
            filename_suffix=f".{os.getpid()}.{next(_writer_numbers)}",
        )
        if run.config:
            self._writer.add_text("config", config_table(run.config), global_step=run.start_step)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self, *, failed: bool) -> None:
        self._writer.close()
