"""The live progress bar of a run on a terminal (rich), and the start-up phase announcements.

The bar moves when a step finishes on the devices, not only at log steps: the loop hands over
each dispatched step's loss (a device array, not fetched), and a background thread checks the
oldest ones with the non-blocking `is_ready()` every POLL_S seconds. Only a finished step's
scalar loss is copied to the host, so the training loop itself never waits for the bar. Its
cost, the thread's CPU time, is logged when the bar closes (docs/performance.md).

Steps/s, tokens/s and the ETA come from rich's speed estimate, which starts at the first step
the bar sees finish: compilation and the first step's warm-up are never part of it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO

import jax
import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often the bar looks for finished steps and redraws


class _TokensPerSecond(ProgressColumn):
    """tokens/s from the bar's steps/s (rich's estimate over the last 30 s)."""

    def __init__(self, tokens_per_step: int) -> None:
        super().__init__()
        self.tokens_per_step = tokens_per_step

    def render(self, task: Task) -> Text:
        speed = task.speed
        return Text(
            "tokens/s=?" if speed is None else f"tokens/s={speed * self.tokens_per_step:,.0f}"
        )


class ProgressBar:
    """`step M/N [bar] loss tokens/s elapsed<ETA`, redrawn in place on `stream` (a terminal).

    Log lines go above it through `print`, so they never land in the middle of the bar. Use it
    as a context manager, or call `close`: the last state stays on screen.
    """

    def __init__(
        self,
        stream: IO[str],
        *,
        total_steps: int,
        start_step: int,
        tokens_per_step: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._progress = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss={task.fields[loss]}"),
            _TokensPerSecond(tokens_per_step),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(file=stream, force_terminal=True, highlight=False),
            auto_refresh=False,  # this class's thread redraws, at most every POLL_S
            redirect_stdout=False,
            redirect_stderr=False,
            get_time=clock,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=start_step, loss="?"
        )
        self._pending: collections.deque[tuple[int, jax.Array]] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = time.perf_counter()
        self._thread_cpu_s = 0.0
        self._wall_s = 0.0
        self._progress.start()
        self._thread = threading.Thread(target=self._run, name="meshtrain-progress", daemon=True)
        self._thread.start()

    def dispatched(self, step: int, loss: jax.Array) -> None:
        """Step `step` was dispatched; `loss` (float32 []) becomes ready when it finishes."""
        self._pending.append((step, loss))

    def print(self, line: str) -> None:
        """Prints a whole line above the bar."""
        with self._lock:
            self._progress.console.print(Text(line), soft_wrap=True)
            self._progress.refresh()

    def _poll(self) -> bool:
        """Moves the bar to the newest finished step, without waiting for any; returns whether
        it moved."""
        finished = None
        while self._pending and self._pending[0][1].is_ready():
            finished = self._pending.popleft()
        if finished is None:
            return False
        step, loss = finished
        self._progress.update(self._task, completed=step, loss=f"{float(np.asarray(loss)):.4f}")
        return True

    def _run(self) -> None:
        start = time.thread_time()
        drawn = time.perf_counter()
        while not self._stop.wait(POLL_S):
            with self._lock:
                # Redraw when a step finished, and each second for the elapsed time.
                if self._poll() or time.perf_counter() - drawn >= 1.0:
                    self._progress.refresh()
                    drawn = time.perf_counter()
        self._thread_cpu_s = time.thread_time() - start

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        with self._lock:
            self._poll()  # the loop fetched its last step's metrics: every step has finished
            self._progress.stop()
        self._wall_s = time.perf_counter() - self._started
        log.debug(
            "progress bar: %.3f s of CPU in %.1f s (%.2f%% of one core)",
            self._thread_cpu_s,
            self._wall_s,
            self.cpu_percent,
        )

    @property
    def thread_cpu_s(self) -> float:
        """CPU seconds the bar's thread used (after close)."""
        return self._thread_cpu_s

    @property
    def wall_s(self) -> float:
        """Seconds from the bar's start to its close (after close)."""
        return self._wall_s

    @property
    def cpu_percent(self) -> float:
        """The CPU time of the bar's thread, in % of one core over the bar's life (after close)."""
        return 100 * self._thread_cpu_s / max(self._wall_s, 1e-9)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def phase(logger: logging.Logger, doing: str, done: str) -> Iterator[None]:
    """Announces a start-up phase as it begins ("compiling the train step...") and logs its
    time when it ends ("compiled the train step in 1.9 s")."""
    logger.info("%s...", doing)
    start = time.perf_counter()
    yield
    logger.info("%s in %.1f s", done, time.perf_counter() - start)
