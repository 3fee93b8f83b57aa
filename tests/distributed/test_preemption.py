"""SIGTERM/SIGINT on a real run: finish the step, save, exit 128 + signal; a second one aborts."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.paths import REPO
from helpers.process import subprocess_env

from meshtrain.checkpoint import committed_steps, read_meta
from meshtrain.distributed.preemption import exit_code_for


def start(run_dir: Path) -> subprocess.Popen:
    """A long single-device run that logs every step and saves only at the end or when stopped."""
    return subprocess.Popen(
        [
            sys.executable,
            "run_training.py",
            "training.steps=100000",
            "training.log_every=1",
            "training.eval_every=0",
            "checkpoint.every_steps=0",
            "data=synthetic",
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
