"""SIGTERM/SIGINT: finish the current step, save, exit 128 + signal; a second signal aborts at once.

Schedulers announce preemption with SIGTERM (SLURM with `--signal`, Kubernetes, most clouds), and
Ctrl-C sends SIGINT. The first one only sets a flag; the loop looks at it after each step, saves
a checkpoint and exits with 128 + the signal number (143 for SIGTERM, 130 for SIGINT), the code a
shell reports for a process the signal ended, meaning "stopped, resumable". A second signal
restores the default action and re-raises itself, so the process dies at once (a half-written
checkpoint is never chosen for resume).

With several processes, all must stop at the same step or the save would wait forever for the
ones still training: they agree with one small all-gather at every `agree_every`-th step, and
after every checkpoint, so that a stop right after a save exits there instead of training and
saving one more step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType, TracebackType

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code_for(signum: int) -> int:
    """The exit code of a run stopped (and checkpointed) by `signum`: 128 + signum."""
    return 128 + signum


class StopSignals:
    """Context manager that turns SIGTERM/SIGINT into a stop request the loop polls."""

    def __init__(self, *, agree_every: int = 1) -> None:
        self.received: int | None = None
        self._agree_every = max(agree_every, 1)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        # Python only runs signal handlers in the main thread; elsewhere leave them alone.
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            log.error("second signal (%s): aborting without saving", name)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        log.warning("received %s: finishing this step, saving a checkpoint, then exiting", name)

    def stop_requested(self, step: int, *, agree_now: bool = False) -> bool:
        """Whether to stop after `step`; the same answer on every process. The processes agree
        at every `agree_every`-th step, and at any step where all of them pass `agree_now`
        (the loop does after a checkpoint, so a signal that came during the save stops there)."""
        if jax.process_count() == 1:
            return self.received is not None
        if step % self._agree_every and not agree_now:
            return False
        signals = multihost_utils.process_allgather(np.int32(self.received or 0))
        if self.received is None and np.any(signals):
            self.received = int(np.max(signals))
        return bool(np.any(signals))
