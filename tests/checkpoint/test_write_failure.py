"""A checkpoint write the disk fails becomes one CheckpointWriteError naming its step (exit code
4): OrbaxWrites driven with a stand-in for orbax's CheckpointManager. The real command line, on
a real disk: test_write_failure_cli.py.
"""

import errno
import logging
from pathlib import Path

import pytest

from meshtrain.checkpoint import writes as writes_module
from meshtrain.checkpoint.writes import (
    CheckpointWriteError,
    OrbaxWrites,
    failed_errno,
    short_cause,
)
from meshtrain.cli.exit import EXIT_CHECKPOINT_WRITE

ENOSPC_FROM_TENSORSTORE = (
    'RESOURCE_EXHAUSTED: Error writing "nonfinite.first_loss/0" in OCDBT database at local file '
    '"/ckpt/10.orbax-checkpoint-tmp/train_state.orbax-checkpoint-tmp/ocdbt.process_0/": Failed '
    'writing: "/ckpt/10.orbax-checkpoint-tmp/d/1cdac7": Failed to write 1869997 bytes to file '
    "12: No space left on device [os_error_code='28']"
)


@pytest.fixture(autouse=True)
def _orbax_reports_pass_again():
    """After a failure, what orbax's threads report stays dropped until the next save; the
    tests of this module leave it as they found it."""
    yield
    writes_module._HELD_BACK.set_mode("pass")


def test_the_exit_code_is_the_documented_one():
    assert CheckpointWriteError.exit_code == EXIT_CHECKPOINT_WRITE == 4


@pytest.mark.parametrize(
    ("err", "code", "cause"),
    [
        (ValueError(ENOSPC_FROM_TENSORSTORE), errno.ENOSPC, "No space left on device"),
        (
            PermissionError(errno.EACCES, "Permission denied", "/ckpt/10.tmp"),
            13,
            "Permission denied",
        ),
        (OSError(errno.EROFS, "Read-only file system"), errno.EROFS, "Read-only file system"),
        (
            ValueError('PERMISSION_DENIED: Error opening "/x/y"'),
            errno.EACCES,
            'Error opening "/x/y"',
        ),
        (RuntimeError("Timeout waiting for key 'awaitable'"), None, None),
    ],
)
def test_the_cause_in_a_few_words(err, code, cause):
    assert failed_errno(err) == code
    if cause is not None:
        assert short_cause(err) == cause


def test_the_cause_is_found_behind_orbax_wrappers():
    try:
        try:
            raise PermissionError(errno.EACCES, "Permission denied")
        except OSError as inner:
            raise RuntimeError("Save Finalize thread failed") from inner
    except RuntimeError as outer:
        assert failed_errno(outer) == errno.EACCES
        assert short_cause(outer) == "Permission denied"


class _Orbax:
    """Stands in for orbax's CheckpointManager: `fail_save` / `fail_wait` raise there."""

    def __init__(self, fail_save=None, fail_wait=None):
        self.fail_save, self.fail_wait = fail_save, fail_wait
        self.closed = False

    def save(self, step, args, force):
        if self.fail_save:
            logging.getLogger("absl").error("orbax: the write failed", exc_info=self.fail_save)
            raise self.fail_save

    def wait_until_finished(self):
        if self.fail_wait:
            logging.getLogger("absl").exception("orbax: Save Finalize thread failed")
            raise self.fail_wait

    def close(self):
        self.closed = True


def _step_dir(directory: Path, step: int) -> None:
    """A committed checkpoint, as far as committed_steps can tell."""
    for item in ("params", "train_state", "meta"):
        (directory / str(step) / item).mkdir(parents=True)


def test_a_write_that_fails_at_once_names_its_step_and_that_nothing_is_complete(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(CheckpointWriteError) as err:
        OrbaxWrites(tmp_path, keep=3).save(_Orbax(fail_save=full), 5, args=None)
    assert str(err.value) == (
        f"writing checkpoint 5 to {tmp_path} failed: No space left on device; no checkpoint is "
        "complete yet (run the same command again once the disk has room)"
    )
    assert err.value.exit_code == 4


def test_a_background_write_that_failed_is_found_at_the_next_save(tmp_path, caplog):
    _step_dir(tmp_path, 5)
    writes, orbax = OrbaxWrites(tmp_path, keep=3), _Orbax()
    writes.save(orbax, 10, args=None)
    orbax.fail_wait = ValueError(ENOSPC_FROM_TENSORSTORE)
    with caplog.at_level(logging.ERROR), pytest.raises(CheckpointWriteError) as err:
        writes.save(orbax, 15, args=None)
    assert str(err.value) == (
        f"writing checkpoint 10 to {tmp_path} failed: No space left on device; the last "
        "complete checkpoint is 5 (resume with the same command once the disk has room)"
    )
    # orbax's own report with its traceback is held back, kept on the error for
    # HYDRA_FULL_ERROR=1; the broken manager is never waited for or closed again.
    assert not caplog.records
    assert [r.getMessage() for r in err.value.held.records] == [
        "orbax: Save Finalize thread failed"
    ]
    writes.close(orbax)
    assert not orbax.closed


def test_a_failure_found_at_close_names_the_last_step(tmp_path):
    _step_dir(tmp_path, 5)
    writes, orbax = OrbaxWrites(tmp_path, keep=3), _Orbax()
    writes.save(orbax, 10, args=None)
    orbax.fail_wait = PermissionError(errno.EROFS, "Read-only file system")
    with pytest.raises(CheckpointWriteError) as err:
        writes.close(orbax)
    assert str(err.value) == (
        f"writing checkpoint 10 to {tmp_path} failed: Read-only file system; the last complete "
        "checkpoint is 5 (resume with the same command once the directory is writable again)"
    )


def test_a_failed_deletion_of_old_checkpoints_after_a_commit_says_so(tmp_path):
    _step_dir(tmp_path, 5)
    writes, orbax = OrbaxWrites(tmp_path, keep=1), _Orbax()
    writes.save(orbax, 10, args=None)
    _step_dir(tmp_path, 10)  # committed, then deleting 5 failed
    orbax.fail_wait = PermissionError(errno.EACCES, "Permission denied")
    with pytest.raises(CheckpointWriteError) as err:
        writes.wait(orbax)
    assert str(err.value) == (
        f"deleting old checkpoints in {tmp_path} (checkpoint.keep=1) failed: Permission denied; "
        "the last complete checkpoint is 10 (resume with the same command once the directory "
        "is writable again)"
    )


def test_an_error_that_is_not_the_disks_is_raised_as_it_is_with_orbaxs_log(tmp_path, caplog):
    bug = TypeError("unsupported leaf")
    with caplog.at_level(logging.ERROR), pytest.raises(TypeError):
        OrbaxWrites(tmp_path, keep=3).save(_Orbax(fail_save=bug), 5, args=None)
    assert [r.getMessage() for r in caplog.records] == ["orbax: the write failed"]


def test_what_orbax_reports_about_a_write_that_commits_is_shown_after_all(tmp_path, caplog):
    writes, orbax = OrbaxWrites(tmp_path, keep=3), _Orbax()
    with caplog.at_level(logging.ERROR):
        writes.save(orbax, 5, args=None)
        logging.getLogger("absl").error("orbax: retrying a slow write")
        assert not caplog.records  # held while the write is in flight
        writes.close(orbax)
    assert [r.getMessage() for r in caplog.records] == ["orbax: retrying a slow write"]
    assert orbax.closed
