"""The non-finite guard: stop with a message and exit code 3, never saving the bad state; or skip.

A learning rate of 1e30 makes the first update blow the weights up, so step 2's gradient norm
is NaN: a deterministic way to meet a non-finite step.
"""

import jax
import numpy as np
import pytest
from helpers.commands import train_command
from helpers.runs import train_tiny

from meshtrain.checkpoint import committed_steps, read_meta

BLOW_UP = ("training.learning_rate=1e30", "training.warmup_steps=1", "training.eval_every=0")
# Random tokens in short sequences: the guard does not look at the data.
DATA = ("data=synthetic", "data.seq_len=32")


@pytest.mark.slow
def test_nonfinite_stop_names_the_step_and_never_saves_it(tmp_path):
    result = train_command(
        *BLOW_UP,
        "training.steps=5",
        "training.log_every=10",  # the check before the save of step 2 catches it
        "checkpoint.every_steps=1",
        *DATA,
        f"hydra.run.dir={tmp_path}",
        devices=1,
    )
    assert result.returncode == 3, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("meshtrain: error: step 2 is not finite: loss="), last
    assert (
        ", grad_norm=nan (training.nonfinite=stop); training stopped and the last checkpoint is "
        in last
    )
    assert last.endswith(
        f"{tmp_path}/checkpoints/1; lower training.learning_rate, or set "
        "training.nonfinite=skip to drop such updates"
    )
    assert "Traceback" not in result.stderr
    assert committed_steps(tmp_path / "checkpoints") == [1]
    assert not list((tmp_path / "checkpoints").glob("2*"))


@pytest.mark.slow
def test_nonfinite_skip_drops_the_updates_and_counts_them(run_dir):
    result = train_tiny(
        run_dir,
        *BLOW_UP,
        "training.nonfinite=skip",
        "training.steps=4",
        "training.log_every=1",
        "checkpoint.every_steps=1",
        "checkpoint.keep=4",
        "checkpoint.async_save=false",  # the synchronous path, for once
        *DATA,
        devices=1,
    )
    assert [h["nonfinite_skips"] for h in result.history] == [0, 1, 2, 3]
    assert np.isfinite(result.history[0]["grad_norm"])
    assert all(np.isnan(h["grad_norm"]) for h in result.history[1:])
    record = jax.device_get(result.state.nonfinite)
    assert (int(record.skipped), int(record.first_step)) == (3, 2)
    assert np.isnan(record.first_grad_norm) and int(result.state.step) == 4
    # Parameters and optimizer state stay those after step 1; only the step and record move on.
    after_1, after_4 = (read_meta(run_dir / "checkpoints" / s)["fingerprints"] for s in "14")
    kept = [name for name in after_1 if name.startswith(("params.", "train_state.opt_state."))]
    assert len(kept) > 40
    assert {name: after_4[name] for name in kept} == {name: after_1[name] for name in kept}
    assert after_4["train_state.step"] != after_1["train_state.step"]
    assert committed_steps(run_dir / "checkpoints") == [1, 2, 3, 4]
