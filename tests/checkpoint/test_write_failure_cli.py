"""A checkpoint write the disk fails stops `python run_training.py` in one line, exit code 4,
and the same command resumes once the disk is fixed.

Each run is changed under at an exact point: the test hook MESHTRAIN_TEST_KILL_AFTER_SAVE=
<step>:stop (meshtrain.checkpoint.writes) makes it stop itself (SIGSTOP) once the checkpoint of
<step> has committed; the test then makes a directory read-only or fills the disk, and lets it
go on (SIGCONT).

Root ignores file modes (CAP_DAC_OVERRIDE), so these runs start through a few lines of ctypes
that drop CAP_DAC_OVERRIDE and CAP_FOWNER (from the bounding and inheritable sets too, so that
the exec'd Python keeps them dropped); for any other user they change nothing.
"""

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.commands import train_command
from helpers.one_process import CONSTANT_RUN
from helpers.paths import REPO
from helpers.process import scratch_dir, subprocess_env

from meshtrain.checkpoint import committed_steps
from meshtrain.checkpoint.writes import TEST_KILL_ENV
from meshtrain.cli.exit import EXIT_CHECKPOINT_WRITE

# Drops CAP_DAC_OVERRIDE (1) and CAP_FOWNER (3), then execs argv[1:]: root obeys file modes.
_DROP_CAPS = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for cap in (1, 3):
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; fails harmlessly without CAP_SETPCAP
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]
header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
if libc.capget(ctypes.byref(header), data) == 0:
    mask = ~((1 << 1) | (1 << 3)) & 0xFFFFFFFF
    data[0].effective &= mask; data[0].permitted &= mask; data[0].inheritable &= mask
    libc.capset(ctypes.byref(header), data)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def _obeying_file_modes(*args: str | Path) -> list[str]:
    return [sys.executable, "-c", _DROP_CAPS, *map(str, args)]


@pytest.fixture(scope="module")
def file_modes_apply(tmp_path_factory):
    """Skips unless a process started by _obeying_file_modes is refused by a read-only dir."""
    directory = tmp_path_factory.mktemp("read_only")
    directory.chmod(0o555)
    probe = subprocess.run(
        _obeying_file_modes("-c", f"open('{directory}/x', 'w')"), capture_output=True, text=True
    )
    directory.chmod(0o755)
    if probe.returncode == 0:
        pytest.skip("this process cannot drop CAP_DAC_OVERRIDE: file modes do not stop it")


# CONSTANT_RUN: the program every one-device child of the test run shares (compiled once).
CONFIG = (*CONSTANT_RUN, "training.log_every=5", "checkpoint.every_steps=5")


class _Run:
    """`python run_training.py` stopped by the test hook once checkpoint `stop_at` committed."""

    def __init__(self, run_dir: Path, *overrides: str, stop_at: int = 5) -> None:
        self.run_dir = run_dir
        env = subprocess_env(1)
        env[TEST_KILL_ENV] = f"{stop_at}:stop"
        self.out, self.err = run_dir.with_suffix(".out"), run_dir.with_suffix(".err")
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                _obeying_file_modes(REPO / "run_training.py", *CONFIG, *overrides),
                cwd=scratch_dir(),
                env=env,
                stdout=out,
                stderr=err,
            )
        _, status = os.waitpid(self.process.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), self.err.read_text()[-3000:]

    def go_on(self) -> tuple[int, str, str]:
        """Lets it run to its end: (exit code, stdout, stderr)."""
        os.kill(self.process.pid, signal.SIGCONT)
        self.process.wait(timeout=300)
        return self.process.returncode, self.out.read_text(), self.err.read_text()


def _assert_one_line(code: int, stdout: str, stderr: str, expected: str) -> None:
    assert code == EXIT_CHECKPOINT_WRITE, stderr[-3000:]
    assert stderr.splitlines() == [f"meshtrain: error: {expected}"], stderr[-3000:]
    assert "Traceback" not in stdout and "Event loop is closed" not in stdout


def _resume(*overrides: str) -> str:
    """The same command once the disk is fixed, run in this process; its stdout."""
    result = train_command(*CONFIG, *overrides, devices=1)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow  # a training process stopped and failed, then its resume here
def test_a_directory_made_read_only_mid_run_stops_in_one_line_and_resumes(
    tmp_path, file_modes_apply
):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    overrides = ("training.steps=15", f"hydra.run.dir={run_dir}")
    run = _Run(run_dir, *overrides)
    checkpoints.chmod(0o555)
    try:
        code, stdout, stderr = run.go_on()  # step 10's write fails, found at step 15's save
    finally:
        checkpoints.chmod(0o755)
    _assert_one_line(
        code,
        stdout,
        stderr,
        f"writing checkpoint 10 to {checkpoints} failed: Permission denied; the last complete "
        "checkpoint is 5 (resume with the same command once the directory is writable again)",
    )
    assert committed_steps(checkpoints) == [5]
    # The lock could not be deleted in the read-only directory: emptied, it names no holder.
    assert (checkpoints / ".meshtrain.lock").read_text() == ""

    stdout = _resume(*overrides)
    assert f"resuming from {checkpoints}/5 at step 5" in stdout
    assert "took over the lock" not in stdout
    assert committed_steps(checkpoints) == [5, 10, 15]
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 5, 6, 10, 15]  # each once


@pytest.mark.slow
def test_a_synchronous_last_save_into_a_read_only_directory(tmp_path, file_modes_apply):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    run = _Run(
        run_dir, "training.steps=10", "checkpoint.async_save=false", f"hydra.run.dir={run_dir}"
    )
    checkpoints.chmod(0o555)
    try:
        code, stdout, stderr = run.go_on()
    finally:
        checkpoints.chmod(0o755)
    _assert_one_line(
        code,
        stdout,
        stderr,
        f"writing checkpoint 10 to {checkpoints} failed: Permission denied; the last complete "
        "checkpoint is 5 (resume with the same command once the directory is writable again)",
    )
    assert committed_steps(checkpoints) == [5]


@pytest.mark.slow
def test_a_failed_deletion_of_an_old_checkpoint_stops_in_one_line(tmp_path, file_modes_apply):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    run = _Run(run_dir, "training.steps=15", "checkpoint.keep=1", f"hydra.run.dir={run_dir}")
    (checkpoints / "5").chmod(0o555)  # its entries cannot be deleted: pruning it fails
    try:
        code, stdout, stderr = run.go_on()
    finally:
        (checkpoints / "5").chmod(0o755)
    _assert_one_line(
        code,
        stdout,
        stderr,
        f"deleting old checkpoints in {checkpoints} (checkpoint.keep=1) failed: Permission "
        "denied; the last complete checkpoint is 10 (resume with the same command once the "
        "directory is writable again)",
    )
    assert 10 in committed_steps(checkpoints)


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB tmpfs (mounting needs root); unmounted afterwards."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(disk: Path) -> Path:
    """A file that takes all the room left on `disk`."""
    filler = disk / "filler"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with filler.open("wb") as file:
        os.posix_fallocate(file.fileno(), 0, free)
    return filler


@pytest.mark.slow  # a training process stopped and failed, then its resume here
def test_a_full_disk_stops_in_one_line_and_the_run_resumes_once_it_has_room(tmp_path, small_disk):
    run_dir = tmp_path / "run"
    overrides = ("training.steps=15", "checkpoint.keep=1", f"checkpoint.dir={small_disk}")
    overrides += (f"hydra.run.dir={run_dir}",)
    run = _Run(run_dir, *overrides)
    filler = _fill(small_disk)
    code, stdout, stderr = run.go_on()
    _assert_one_line(
        code,
        stdout,
        stderr,
        f"writing checkpoint 10 to {small_disk} failed: No space left on device; the last "
        "complete checkpoint is 5 (resume with the same command once the disk has room)",
    )
    assert committed_steps(small_disk) == [5]
    assert stat.S_ISREG(filler.stat().st_mode)

    filler.unlink()
    stdout = _resume(*overrides)
    assert f"resuming from {small_disk}/5 at step 5" in stdout
    assert committed_steps(small_disk) == [15]
