"""The reference the multi-process tests compare with: the losses of `python run_training.py
CONSTANT_RUN` as one process on one device, run here, in the test process
(helpers.commands.train_command on its first device), once per test run, and shared by every
test that compares a multi-process run of that shape with it, on whatever mesh.

One device, because every mesh of one process gives its losses (to rtol 1e-5: the mesh-equality
tests of tests/train/test_loop.py; ~7e-7 measured over 24 steps): a multi-process run that matches
them matches one process on its own mesh too, and one small compile serves every mesh. In this
process, because a child Python would pay JAX's import and load its programs again. The
multi-process runs themselves stay real processes (the tests are about them).

CONSTANT_RUN has a constant learning rate after warmup (training.lr_schedule=constant): the rate
of a step, the step's program and the batches do not depend on training.steps, so the first steps
of a longer run are those of a shorter one (the checkpoint tests rely on this too), and one run of
REFERENCE_STEPS answers every request up to that many steps.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from helpers.commands import train_command
from helpers.runs import SMALL_RUN, losses

# SMALL_RUN with the constant schedule: the shape of the multi-process tests and their reference.
CONSTANT_RUN = (*SMALL_RUN, "training.lr_schedule=constant")
# The longest run a test compares with (tests/distributed/test_runtime_torchrun.py's restart).
REFERENCE_STEPS = 24


@functools.cache
def _reference(steps: int) -> list[float]:
    run_dir = Path(tempfile.mkdtemp(prefix="meshtrain-test-one-device-"))
    atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
    result = train_command(
        *CONSTANT_RUN,
        "model.mesh_shape=[[1,1],[fsdp,tp]]",
        f"training.steps={steps}",
        f"hydra.run.dir={run_dir}",
        devices=1,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = losses(run_dir / "metrics.jsonl")
    assert len(got) == steps, got
    return got


def one_device_losses(steps: int) -> list[float]:
    """The losses of steps 1..steps of CONSTANT_RUN on one device (run once per test run, for
    REFERENCE_STEPS steps, or for `steps` if more)."""
    return _reference(max(steps, REFERENCE_STEPS))[:steps]
