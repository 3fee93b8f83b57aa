"""SIGTERM/SIGINT on a real run: finish the step, save, exit 128 + signal; a second one aborts."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.one_process import CONSTANT_RUN
from helpers.paths import REPO
from helpers.process import subprocess_env
from helpers.runs import SMALL_RUN, train_tiny
from jax.experimental import multihost_utils

from meshtrain.checkpoint import RunCheckpoints, committed_steps, read_meta
from meshtrain.distributed.preemption import StopSignals, exit_code_for


def start(run_dir: Path) -> subprocess.Popen:
    """A long single-device run of a one-layer model that logs every step and saves only at the
    end or when stopped (CONSTANT_RUN: the program every one-device child of the test run
    shares, compiled once)."""
    return subprocess.Popen(
        [
            sys.executable,
            "run_training.py",
            *CONSTANT_RUN,
            "training.steps=100000",
            "checkpoint.every_steps=0",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        env=subprocess_env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(path: Path, text: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{text!r} did not appear in {path}"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_143(tmp_path):
    process = start(tmp_path)
    wait_for(tmp_path / "metrics.jsonl", '"step": 3,', process)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == exit_code_for(signal.SIGTERM) == 143, output[-3000:]
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert last >= 3
    # The checkpoint holds the state after the last step taken, and the data position after it.
    assert committed_steps(tmp_path / "checkpoints") == [last]
    meta = read_meta(tmp_path / "checkpoints" / str(last))
    assert meta["step"] == last and meta["data"]["step"] == last
    assert "received SIGTERM: finishing this step, saving a checkpoint, then exiting" in output
    assert f"stopped by SIGTERM; checkpoint {tmp_path}/checkpoints/{last} is complete" in output


@pytest.mark.slow  # a third launch of its own; the SIGTERM path above is the one that matters
def test_a_second_signal_aborts_at_once(tmp_path):
    process = start(tmp_path)
    wait_for(tmp_path / "metrics.jsonl", '"step": 2,', process)
    process.send_signal(signal.SIGINT)
    # The second signal goes in once the first is handled (two at once may merge into one);
    # finishing the step and saving leaves well over a second for it to arrive.
    wait_for(tmp_path / "train.log", "received SIGINT", process)
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == -signal.SIGINT, output[-3000:]
    assert "second signal (SIGINT): aborting without saving" in output
    assert committed_steps(tmp_path / "checkpoints") == []


@pytest.mark.slow
def test_a_signal_during_a_periodic_save_stops_there_without_one_more_checkpoint(
    tmp_path, monkeypatch
):
    """SIGTERM while checkpoint 4 (checkpoint.every_steps=4) is being saved: the run stops on
    it, neither training step 5 nor saving it (checkpoints 4 and 5 back to back before)."""
    save = RunCheckpoints.save

    def save_then_signal(self, step, *args):
        save(self, step, *args)
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(RunCheckpoints, "save", save_then_signal)
    result = train_tiny(
        tmp_path, *SMALL_RUN, "training.steps=20", "checkpoint.every_steps=4", devices=1
    )
    assert result.stopped_by == signal.SIGTERM
    assert [h["step"] for h in result.history] == [1, 2, 3, 4]
    assert committed_steps(tmp_path / "checkpoints") == [4]


def test_processes_agree_on_a_stop_after_a_save_between_agreement_steps(monkeypatch):
    """Several processes agree every agree_every steps, and at once where all pass agree_now
    (after a save): there a signal another process received stops every one of them."""
    gathered = []

    def allgather(value):
        gathered.append(int(value))
        return np.array([int(value), int(signal.SIGTERM)])  # the other process has SIGTERM

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    signals = StopSignals(agree_every=100)
    assert signals.stop_requested(4) is False and gathered == []
    assert signals.stop_requested(4, agree_now=True) is True
    assert gathered == [0] and signals.received == signal.SIGTERM
