"""Crashes: a run SIGKILLed after a checkpoint, or while writing one, resumes bit for bit.

The runs that crash are real `python run_training.py` processes; the test hook
MESHTRAIN_TEST_KILL_AFTER_SAVE (meshtrain.checkpoint.manager) makes one SIGKILL itself at an exact
point. The uninterrupted run and the last resume run the same command in this process
(helpers.commands), on its 8 devices.
"""

import json
import signal
import subprocess

import numpy as np
import pytest
from helpers.commands import CommandResult, train_command
from helpers.process import run_training, subprocess_env

from meshtrain.checkpoint import (
    committed_steps,
    named_leaves,
    read_meta,
    read_params,
)
from meshtrain.checkpoint.writes import TEST_KILL_ENV

CONFIG = (
    "data=synthetic",
    "data.seq_len=32",
    "model.num_layers=1",
    'model.mesh_shape=[[4,2],["fsdp","tp"]]',
    "training.micro_batch_size=2",
    "training.steps=9",
    "training.warmup_steps=1",
    "training.log_every=1",
    "training.eval_every=0",
    "checkpoint.every_steps=3",
    "checkpoint.keep=1",
)


def launch(run_dir, kill: str) -> subprocess.CompletedProcess:
    """A child process that SIGKILLs itself where `kill` says (TEST_KILL_ENV)."""
    env = subprocess_env(8)
    env[TEST_KILL_ENV] = kill
    return run_training(*CONFIG, f"hydra.run.dir={run_dir}", env=env, timeout=600)


def run_here(run_dir) -> CommandResult:
    """The same command to its end, in this process."""
    return train_command(*CONFIG, f"hydra.run.dir={run_dir}", devices=8)


def losses(run_dir) -> dict[int, float]:
    """Step → loss, checking that metrics.jsonl logs each step once, in order."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines]
    assert steps == sorted(set(steps)), steps
    return {line["step"]: line["loss"] for line in lines}


@pytest.mark.slow  # two processes SIGKILLed, two runs here
def test_sigkill_and_a_half_written_checkpoint_resume_bit_identically(tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    checkpoints = crashed / "checkpoints"
    result = run_here(straight)
    assert result.returncode == 0, result.stderr[-3000:]

    # 1. SIGKILL right after the checkpoint of step 3 has committed.
    result = launch(crashed, kill="3")
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert committed_steps(checkpoints) == [3]

    # 2. Resumed, then SIGKILLed while the checkpoint of step 6 is being written: its files are
    #    still under a temporary name, and with keep=1 step 3 must not have been pruned yet.
    result = launch(crashed, kill="6:writing")
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert f"resuming from {checkpoints}/3 at step 3" in result.stdout
    assert committed_steps(checkpoints) == [3]
    assert list(checkpoints.glob("6.orbax-checkpoint-tmp*")), "no half-written checkpoint to ignore"

    # 3. Resumed again: the half-written step 6 is ignored (and cleaned up).
    result = run_here(crashed)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {checkpoints}/3 at step 3" in result.stdout
    assert not list(checkpoints.glob("*.orbax-checkpoint-tmp*"))
    assert committed_steps(checkpoints) == [9]

    # Losses of steps 4..9 and the whole final state (parameters, Adam moments, step, RNG key,
    # data position) are bit-identical to the uninterrupted run's.
    expected, got = losses(straight), losses(crashed)
    assert list(got) == list(range(1, 10))  # three attempts, each step logged once
    assert [got[step] for step in range(4, 10)] == [expected[step] for step in range(4, 10)]
    final, reference = read_meta(checkpoints / "9"), read_meta(straight / "checkpoints" / "9")
    assert final["fingerprints"] == reference["fingerprints"]
    assert final["data"] == reference["data"] == {"step": 9, "position": 72}
    params = named_leaves(read_params(checkpoints / "9")[0])
    reference_params = named_leaves(read_params(straight / "checkpoints" / "9")[0])
    assert params.keys() == reference_params.keys()
    for name, array in params.items():
        np.testing.assert_array_equal(
            array.view(np.uint32), reference_params[name].view(np.uint32), err_msg=name
        )
