"""One run per directory: a second run in a run's checkpoint.dir is refused before it compiles.

Two runs in one directory destroy each other's work: one's clean-up deletes the other's half-
written checkpoint, one's pruning deletes the checkpoints the other is reading. So a run holds
`<dir>/.meshtrain.lock` with `fcntl.flock(LOCK_EX | LOCK_NB)` from RunCheckpoints.open to its
close: the lock of its checkpoint.dir and, when that lies outside the run directory, of the run
directory too. Only process 0 of a multi-process run takes them. The file holds the holder's
host, pid and start time as JSON, for the message that refuses a second run.

The kernel drops a flock when its process dies, and a run that ends deletes its lock file. So a
lock file that can be locked but names a holder was left by a run that is gone (killed, crashed
or on a machine that went down): it is taken over, with one log line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

import jax

from meshtrain.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = ".meshtrain.lock"
# A holder writes its JSON right after taking the flock: a second run that finds the file locked
# but still empty reads it again for this long before it reports an unknown holder.
_READ_HOLDER_S = 1.0
# Filesystems where flock cannot work (some cluster filesystems): the run goes on unlocked.
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


@dataclass(frozen=True)
class Holder:
    """The run that holds (or held) a lock."""

    host: str
    pid: int
    since: str  # local time, "%Y-%m-%d %H:%M:%S"

    @classmethod
    def me(cls) -> Holder:
        """This process, now."""
        return cls(socket.gethostname(), os.getpid(), time.strftime("%Y-%m-%d %H:%M:%S"))

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder a lock file names, or None for an empty or unreadable one."""
        try:
            fields = json.loads(text)
            return cls(str(fields["host"]), int(fields["pid"]), str(fields["since"]))
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} since {self.since}"


class DirectoryLock:
    """The exclusive lock of one directory for the life of a run; `key` is the config key that
    names the directory in messages (checkpoint.dir, hydra.run.dir)."""

    def __init__(self, directory: Path, key: str) -> None:
        self.directory = directory
        self.key = key
        self.path = directory / LOCK_NAME
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> DirectoryLock:
        """Takes the lock, taking over a stale one; raises ConfigError if another run holds it."""
        while True:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                file = self.path.open("a+", encoding="utf-8")  # created if missing, never truncated
            except OSError as err:
                raise ConfigError(
                    f"{self.key}={self.directory} is not writable ({err.strerror or err}); "
                    f"set {self.key}=<a writable directory>"
                ) from None
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(file)
                file.close()
                raise ConfigError(self._in_use_message(holder)) from None
            except OSError as err:
                file.close()
                if err.errno not in _UNSUPPORTED:
                    raise
                log.warning(
                    "cannot lock %s (%s): make sure no other run uses it",
                    self.directory,
                    err.strerror,
                )
                return self
            if _same_file(file, self.path):
                break
            file.close()  # its holder deleted it while we waited for the flock: lock the new one
        file.seek(0)
        stale = Holder.parse(file.read())
        if stale is not None:
            log.warning("took over the lock of a run that is gone (%s)", _pid_and_host(stale))
        file.seek(0)
        file.truncate()
        file.write(json.dumps(asdict(Holder.me())))
        file.flush()
        self._file = file
        return self

    def release(self) -> None:
        """Deletes the lock file and drops the lock (in that order: a run that opened the file
        meanwhile finds it deleted and locks a new one). Does nothing if not held."""
        if self._file is None:
            return
        file, self._file = self._file, None
        try:
            self.path.unlink(missing_ok=True)
        except OSError:  # a read-only directory: emptied, the file names no holder
            with suppress(OSError):
                file.truncate(0)
        file.close()

    def _in_use_message(self, holder: Holder | None) -> str:
        who = holder.describe() if holder else f"its lock file {self.path} names no holder"
        return (
            f"{self.key}={self.directory} is in use by another run ({who}); wait for it to "
            "finish, or give this run another hydra.run.dir or checkpoint.dir"
        )


class RunLocks:
    """The locks of one run (see the module docstring); released together, also as a context
    manager."""

    def __init__(self, locks: list[DirectoryLock]) -> None:
        self.locks = locks

    @classmethod
    def acquire(cls, checkpoint_dir: Path, run_dir: Path) -> RunLocks:
        """Locks `checkpoint_dir` and, when it lies outside it, `run_dir` (process 0 only; the
        other processes get no locks). Raises ConfigError, holding nothing, if either is in use."""
        if jax.process_index() != 0:
            return cls([])
        wanted = [DirectoryLock(checkpoint_dir, "checkpoint.dir")]
        run_dir = Path(run_dir).resolve()
        if not checkpoint_dir.is_relative_to(run_dir):
            wanted.append(DirectoryLock(run_dir, "hydra.run.dir"))
        locks = cls([])
        try:
            for lock in wanted:
                locks.locks.append(lock.acquire())
        except BaseException:
            locks.release()
            raise
        return locks

    def release(self) -> None:
        """Releases every lock (the last taken first); safe to call more than once."""
        for lock in reversed(self.locks):
            lock.release()

    def __enter__(self) -> RunLocks:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _read_holder(file: IO[str]) -> Holder | None:
    """The holder a locked file names, read again while it is still empty (just taken)."""
    deadline = time.monotonic() + _READ_HOLDER_S
    while True:
        file.seek(0)
        holder = Holder.parse(file.read())
        if holder is not None or time.monotonic() > deadline:
            return holder
        time.sleep(0.05)


def _same_file(file: IO[str], path: Path) -> bool:
    """Whether `path` still names the open `file` (not deleted or replaced since it was opened)."""
    try:
        now, opened = os.stat(path), os.fstat(file.fileno())
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)


def _pid_and_host(holder: Holder) -> str:
    return f"pid {holder.pid} on host {holder.host}"
