"""Checkpoint writes that fail (disk full, read-only, no permission) stop the run in one line.

orbax writes a checkpoint in background threads; when the disk fails them, each thread logs its
own traceback, the error surfaces at the next save, at `wait_until_finished` or at close, and
some threads go on waiting minutes for a signal that never comes. Here every such failure
becomes one CheckpointWriteError naming the step whose write failed, the directory, a short
cause and the last complete checkpoint, e.g.

    writing checkpoint 10 to /runs/a/checkpoints failed: No space left on device; the last
    complete checkpoint is 5 (resume with the same command once the disk has room)

What orbax's threads report while a write is in flight (absl's error log records, exceptions
in threads Python cannot raise) is held back: a failure carries it (`held`, shown with
HYDRA_FULL_ERROR=1), a write that commits lets it through.
Checkpoints already complete are never touched by a failed write (orbax writes under a
temporary name), so the same command resumes from the last complete one. After a failure some
of orbax's threads may linger until its own timeout (minutes): the command line ends the process
at once (meshtrain.cli.train); an in-process caller should do the same.

Test hook (tests only; never set it otherwise): with MESHTRAIN_TEST_KILL_AFTER_SAVE=<step> the
process SIGKILLs itself as soon as the checkpoint of <step> has committed; with
<step>:writing right after that save has started, while it is still being written; with
<step>:stop it stops itself (SIGSTOP) once the checkpoint of <step> has committed, so that a
test can change the disk under it (fill it, make it read-only) and send SIGCONT.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from meshtrain.checkpoint.layout import committed_steps

TEST_KILL_ENV = "MESHTRAIN_TEST_KILL_AFTER_SAVE"

_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})
_NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
# tensorstore's errors carry the errno as `[os_error_code='28']`, or only a status name.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_STATUS_ERRNO = {"RESOURCE_EXHAUSTED": errno.ENOSPC, "PERMISSION_DENIED": errno.EACCES}
_MAX_CAUSE = 200


class CheckpointWriteError(RuntimeError):
    """A checkpoint write the disk failed; the message is the one line the command prints."""

    exit_code = 4  # meshtrain.cli.exit.EXIT_CHECKPOINT_WRITE (no import: cli is above us)

    def __init__(self, message: str, held: Held) -> None:
        super().__init__(message)
        self.held = held  # what orbax's threads reported about it, not shown


@dataclass
class Held:
    """What orbax's writer threads reported while a write was in flight: absl's error records
    (orbax logs through absl) and the exceptions Python could not raise in a thread
    (sys.unraisablehook: tensorstore's callbacks into an event loop that a failure closed)."""

    records: list[logging.LogRecord] = field(default_factory=list)
    unraisable: list[tuple[str, list[str]]] = field(default_factory=list)  # message, traceback

    def show(self) -> None:
        """Logs and prints them as they would have been."""
        logger = logging.getLogger("absl")
        for record in self.records:
            logger.callHandlers(record)  # past the filter, to the handlers it would have reached
        for message, lines in self.unraisable:
            print(message, "".join(lines), sep="\n", end="", file=sys.stderr)


class _HeldBack(logging.Filter):
    """Installed on absl's logger and as sys.unraisablehook: what orbax's threads report is held
    back while a write is in flight ("hold"), dropped after a failure was reported ("drop") and
    let through otherwise ("pass")."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = "pass"
        self.held = Held()
        self._lock = threading.Lock()
        self._previous_hook: Callable[[Any], object] = sys.unraisablehook

    def filter(self, record: logging.LogRecord) -> bool:
        if self.mode == "pass" or (record.levelno < logging.ERROR and not record.exc_info):
            return True
        if self.mode == "hold":
            with self._lock:
                self.held.records.append(record)
        return False

    def unraisablehook(self, unraisable: Any) -> None:
        if self.mode == "pass":
            self._previous_hook(unraisable)
        elif self.mode == "hold":
            message = f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}"
            lines = traceback.format_exception(
                unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback
            )
            with self._lock:
                self.held.unraisable.append((message, lines))

    def set_mode(self, mode: str) -> Held:
        """Switches to `mode` and returns what was held until now."""
        logger = logging.getLogger("absl")
        if self not in logger.filters:
            logger.addFilter(self)
        if sys.unraisablehook != self.unraisablehook:
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self.unraisablehook
        with self._lock:
            held, self.held, self.mode = self.held, Held(), mode
        return held


_HELD_BACK = _HeldBack()


class OrbaxWrites:
    """The writes of one orbax CheckpointManager into `directory` (keeping the newest `keep`):
    every orbax call that may report a failed write goes through here."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory = directory
        self.keep = keep
        self.pending: int | None = None  # the step whose write is not known to have committed
        self.failed = False  # then orbax's threads may hang: never wait for them again

    def save(self, manager: ocp.CheckpointManager, step: int, args: Any) -> None:
        """Waits for the previous write (its failure names its step), then starts this one."""
        self.wait(manager)
        _HELD_BACK.set_mode("hold")
        with self._reported_as(step):
            manager.save(step, args=args, force=True)
        self.pending = step

    def wait(self, manager: ocp.CheckpointManager) -> None:
        """Waits until the pending write has committed (and old checkpoints are pruned)."""
        if self.pending is None or self.failed:
            return
        with self._reported_as(self.pending):
            manager.wait_until_finished()
        self.pending = None
        _HELD_BACK.set_mode("pass").show()  # what orbax got over: shown after all

    def close(self, manager: ocp.CheckpointManager) -> None:
        """Waits for the pending write and closes `manager`; after a failure, leaves orbax's
        threads alone (some wait minutes for a write that never comes)."""
        if self.failed:
            return
        self.wait(manager)
        manager.close()

    @contextmanager
    def _reported_as(self, step: int) -> Iterator[None]:
        """Turns a failure of the disk inside the block into CheckpointWriteError for `step`;
        any other error is re-raised as it is, with orbax's records shown."""
        try:
            yield
        except Exception as err:
            self.failed = True
            if failed_errno(err) is None:
                _HELD_BACK.set_mode("pass").show()
                raise
            held = _HELD_BACK.set_mode("drop")
            raise CheckpointWriteError(self._message(step, err), held) from err

    def _message(self, step: int, err: BaseException) -> str:
        """The one line for a failure of the write of `step` (or of the pruning after it)."""
        what = f"writing checkpoint {step} to {self.directory}"
        try:
            steps = committed_steps(self.directory)
        except OSError as listing:
            last = f"the last complete checkpoint is unknown ({listing.strerror})"
        else:
            if step in steps:  # it committed: deleting those beyond checkpoint.keep failed
                what = f"deleting old checkpoints in {self.directory} (checkpoint.keep={self.keep})"
            older = [s for s in steps if s <= step]
            last = f"the last complete checkpoint is {older[-1]}" if older else ""
        when = _remedy(failed_errno(err))
        if not last:
            return (
                f"{what} failed: {short_cause(err)}; no checkpoint is complete yet (run the same "
                f"command again {when})"
            )
        return f"{what} failed: {short_cause(err)}; {last} (resume with the same command {when})"


def failed_errno(err: BaseException) -> int | None:
    """The errno of a failed disk operation behind `err` (an OSError in its chain, or the code
    in a tensorstore message), or None if `err` is no failure of the disk."""
    for link in _chain(err):
        if isinstance(link, OSError) and link.errno:
            return link.errno
        text = str(link)
        found = _OS_ERROR_CODE.search(text)
        if found:
            return int(found.group(1))
        status = text.split(":", 1)[0].strip()
        if status in _STATUS_ERRNO:
            return _STATUS_ERRNO[status]
    return None


def short_cause(err: BaseException) -> str:
    """A few words for what failed: the OS's text for the errno ("No space left on device"),
    else the end of the first line of the message."""
    for link in _chain(err):
        if isinstance(link, OSError) and link.errno:
            return link.strerror or os.strerror(link.errno)
        found = _OS_ERROR_CODE.search(str(link))
        if found:
            return os.strerror(int(found.group(1)))
    lines = str(err).strip().splitlines()
    line = re.sub(r"\s*\[[^\]]*\]", "", lines[0]) if lines else type(err).__name__
    return line.rsplit(": ", 1)[-1][:_MAX_CAUSE]


def _remedy(code: int | None) -> str:
    if code in _NOT_WRITABLE:
        return "once the directory is writable again"
    if code in _NO_ROOM:
        return "once the disk has room"
    return "once the disk works again"


def _chain(err: BaseException) -> Iterator[BaseException]:
    """`err` and its causes (or contexts), outermost first."""
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def maybe_kill_for_test(writes: OrbaxWrites, manager: ocp.CheckpointManager, step: int) -> None:
    """The test hook described in the module docstring."""
    value = os.environ.get(TEST_KILL_ENV)
    if not value:
        return
    target, _, phase = value.partition(":")
    if int(target) != step:
        return
    if phase != "writing":
        writes.wait(manager)
    os.kill(os.getpid(), signal.SIGSTOP if phase == "stop" else signal.SIGKILL)
