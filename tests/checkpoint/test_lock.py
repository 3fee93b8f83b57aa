"""One run per directory (meshtrain.checkpoint.lock): a second run is refused in one line, a lock
left by a dead run is taken over, and a run that fails to start leaves nothing locked."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.commands import train_command
from helpers.one_process import CONSTANT_RUN
from helpers.paths import REPO
from helpers.process import assert_one_line_error, scratch_dir, subprocess_env
from helpers.runs import train_tiny

from meshtrain.checkpoint import committed_steps
from meshtrain.checkpoint.lock import LOCK_NAME, DirectoryLock, RunLocks
from meshtrain.checkpoint.writes import TEST_KILL_ENV
from meshtrain.errors import ConfigError


def _in_use(key: str, directory, pid: int, since: str) -> str:
    return (
        f"{key}={directory} is in use by another run (pid {pid} on host "
        f"{socket.gethostname()} since {since}); wait for it to finish, or give this run "
        "another hydra.run.dir or checkpoint.dir"
    )


def test_a_second_lock_is_refused_naming_the_holder(tmp_path):
    directory = tmp_path / "checkpoints"
    with RunLocks([DirectoryLock(directory, "checkpoint.dir").acquire()]):
        held = json.loads((directory / LOCK_NAME).read_text())
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
        with pytest.raises(ConfigError) as err:
            DirectoryLock(directory, "checkpoint.dir").acquire()
        assert str(err.value) == _in_use("checkpoint.dir", directory, os.getpid(), held["since"])
    # Released: the file is gone and the next run locks at once, without a takeover.
    assert not (directory / LOCK_NAME).exists()
    lock = DirectoryLock(directory, "checkpoint.dir").acquire()
    assert lock.held
    lock.release()
    lock.release()  # twice is harmless
    assert not (directory / LOCK_NAME).exists()


def test_a_checkpoint_dir_that_cannot_be_written_is_one_line_before_compiling(
    tmp_path, monkeypatch
):
    # This test may run as root, whom no file mode stops: the lock file's open is refused here
    # as a read-only directory refuses it.
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    open_file = Path.open

    def read_only(path, *args, **kwargs):
        if path.name == LOCK_NAME:
            raise PermissionError(13, "Permission denied", str(path))
        return open_file(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "open", read_only)
        with pytest.raises(ConfigError) as err:
            DirectoryLock(directory, "checkpoint.dir").acquire()
    assert str(err.value) == (
        f"checkpoint.dir={directory} is not writable (Permission denied); "
        "set checkpoint.dir=<a writable directory>"
    )
    # A path that cannot be made (a file where a directory should be): refused alike, in the
    # command's one line.
    (tmp_path / "file").write_text("")
    result = train_command(
        "data=synthetic",
        "training.steps=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"checkpoint.dir={tmp_path / 'file' / 'checkpoints'}",
        devices=1,
    )
    assert_one_line_error(
        result, f"checkpoint.dir={tmp_path / 'file' / 'checkpoints'} is not writable (Not a direc"
    )
    assert "compil" not in result.stderr


def test_the_lock_of_a_run_that_is_gone_is_taken_over(tmp_path, caplog):
    (tmp_path / LOCK_NAME).write_text(
        json.dumps({"host": "node-7", "pid": 4242, "since": "2026-11-25 10:00:00"})
    )
    with caplog.at_level(logging.WARNING, logger="meshtrain.checkpoint.lock"):
        lock = DirectoryLock(tmp_path, "checkpoint.dir").acquire()
    assert [r.getMessage() for r in caplog.records] == [
        "took over the lock of a run that is gone (pid 4242 on host node-7)"
    ]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_an_empty_lock_file_is_taken_without_a_word(tmp_path, caplog):
    (tmp_path / LOCK_NAME).write_text("")  # e.g. emptied by a run in a read-only directory
    with caplog.at_level(logging.WARNING, logger="meshtrain.checkpoint.lock"):
        DirectoryLock(tmp_path, "checkpoint.dir").acquire().release()
    assert not caplog.records


def test_a_checkpoint_dir_outside_the_run_dir_locks_both(tmp_path):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    with RunLocks.acquire(elsewhere, run_dir) as locks:
        assert [lock.key for lock in locks.locks] == ["checkpoint.dir", "hydra.run.dir"]
        assert (run_dir / LOCK_NAME).exists() and (elsewhere / LOCK_NAME).exists()
    assert not (run_dir / LOCK_NAME).exists() and not (elsewhere / LOCK_NAME).exists()
    # Inside the run directory, only the checkpoint directory is locked.
    with RunLocks.acquire(run_dir / "checkpoints", run_dir) as locks:
        assert [lock.key for lock in locks.locks] == ["checkpoint.dir"]


def test_a_refused_run_holds_none_of_its_locks(tmp_path):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    holder = DirectoryLock(run_dir, "hydra.run.dir").acquire()
    try:
        with pytest.raises(ConfigError, match=r"^hydra\.run\.dir=.* is in use by another run"):
            RunLocks.acquire(elsewhere, run_dir)
        assert not (elsewhere / LOCK_NAME).exists()  # its first lock was given back
    finally:
        holder.release()


def test_a_run_that_fails_after_opening_its_checkpoints_leaves_them_unlocked(run_dir):
    # checkpoint.load_params is checked after RunCheckpoints.open has taken the lock.
    with pytest.raises(
        ConfigError, match=r"^checkpoint\.load_params=/no/such/checkpoint does not exist"
    ):
        train_tiny(run_dir, "checkpoint.load_params=/no/such/checkpoint", devices=1)
    assert not (run_dir / "checkpoints" / LOCK_NAME).exists()
    DirectoryLock(run_dir / "checkpoints", "checkpoint.dir").acquire().release()


# CONSTANT_RUN: the program every one-device child of the test run shares (compiled once).
CONFIG = (*CONSTANT_RUN, "training.steps=10", "training.log_every=5", "checkpoint.every_steps=5")


@pytest.mark.slow  # a training process, and a second run refused here
def test_a_second_run_in_the_same_directory_is_refused_and_the_first_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    env = subprocess_env(1)
    env[TEST_KILL_ENV] = "5:stop"  # the first run stops itself (SIGSTOP), holding the lock
    with (tmp_path / "first.out").open("w") as out, (tmp_path / "first.err").open("w") as err:
        first = subprocess.Popen(
            [sys.executable, REPO / "run_training.py", *CONFIG, f"hydra.run.dir={run_dir}"],
            cwd=scratch_dir(),
            env=env,
            stdout=out,
            stderr=err,
        )
    try:
        _, status = os.waitpid(first.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), (tmp_path / "first.err").read_text()[-3000:]
        since = json.loads((run_dir / "checkpoints" / LOCK_NAME).read_text())["since"]

        second = train_command(*CONFIG, f"hydra.run.dir={run_dir}", devices=1)
        assert_one_line_error(
            second, _in_use("checkpoint.dir", run_dir / "checkpoints", first.pid, since)
        )
        assert "compiling" not in second.stdout  # refused before anything was compiled
    finally:
        os.kill(first.pid, signal.SIGCONT)
        first.wait(timeout=300)
    assert first.returncode == 0, (tmp_path / "first.err").read_text()[-3000:]
    assert committed_steps(run_dir / "checkpoints") == [5, 10]
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 5, 10]  # the first run's lines, once each
    assert not (run_dir / "checkpoints" / LOCK_NAME).exists()
