"""The live progress bar: it moves when a dispatched step's loss is ready (never waiting for
one), measures tokens/s and the ETA from the steps after the first, and prints log lines above
itself; `phase` announces a start-up phase and its time."""

from __future__ import annotations

import io
import logging
import re
import time

import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.observe.progress import POLL_S, ProgressBar, phase

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True

    def frames(self) -> list[str]:
        """Each line or redraw of the bar, escape codes removed."""
        text = ANSI.sub("", self.getvalue())
        return [frame for frame in re.split(r"[\r\n]", text) if frame.strip()]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _PendingLoss:
    """A loss whose step has not finished yet, until `finish`."""

    def __init__(self, value: float) -> None:
        self.value, self.ready = value, False

    def is_ready(self) -> bool:
        return self.ready

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        assert self.ready, "the bar read a loss before its step finished"
        return np.asarray(self.value, dtype=dtype)


def test_the_bar_moves_per_finished_step_and_never_waits():
    terminal, clock = _Terminal(), _Clock()
    bar = ProgressBar(terminal, total_steps=10, start_step=0, tokens_per_step=1000, clock=clock)
    bar._stop.set()  # drive the polls by hand; the thread is tested end to end in tests/cli
    bar._thread.join()
    clock.now = 30.0  # the first step ends after compilation and warm-up
    bar.dispatched(1, jnp.float32(5.5))
    second = _PendingLoss(4.25)
    bar.dispatched(2, second)
    assert bar._poll()
    bar._progress.refresh()
    assert "step 1/10" in terminal.frames()[-1] and "loss=5.5000" in terminal.frames()[-1]
    assert not bar._poll()  # step 2 is still running: no wait, no move
    for step in range(3, 6):
        bar.dispatched(step, jnp.float32(4.0 - step / 10))
    clock.now = 34.0  # steps 2..5 in 4 s: 1 step/s, 1000 tokens/s, 5 steps left
    second.ready = True
    assert bar._poll()
    bar._progress.refresh()
    last = terminal.frames()[-1]
    assert "step 5/10" in last and "loss=3.5000" in last
    assert "tokens/s=1,000" in last and "eta 0:00:05" in last
    bar._stop.clear()
    bar.close()


def test_log_lines_go_whole_above_the_bar():
    terminal = _Terminal()
    with ProgressBar(terminal, total_steps=4, start_step=2, tokens_per_step=8) as bar:
        bar.print("12:00:00 INFO meshtrain.train.loop: a whole line")
        bar.dispatched(3, jnp.float32(2.0))
        bar.dispatched(4, jnp.float32(1.0))
    frames = terminal.frames()
    assert "12:00:00 INFO meshtrain.train.loop: a whole line" in frames
    assert frames[-1].startswith("step 4/4") and "loss=1.0000" in frames[-1]


def _fast_loop() -> tuple[ProgressBar, _Terminal, float]:
    """A second of steps finishing every 10 ms, as a fast loop hands them over: (the closed
    bar, its terminal, the wall seconds around it)."""
    losses = [jnp.float32(4.0 - i / 100) for i in range(100)]  # made first: not the bar's time
    terminal = _Terminal()
    start = time.perf_counter()
    bar = ProgressBar(terminal, total_steps=100, start_step=0, tokens_per_step=1000)
    for step, loss in enumerate(losses, start=1):
        bar.dispatched(step, loss)
        time.sleep(0.01)
    bar.close()
    return bar, terminal, time.perf_counter() - start


def test_the_bar_redraws_at_its_pace_not_at_every_step():
    """What keeps the bar cheap, checked without a clock's noise: it looks for finished steps
    every POLL_S (0.2 s), so a second of 100 steps is drawn a handful of times, not 100 (a
    thread that redrew every step, or polled without sleeping, would draw far more)."""
    bar, terminal, outside = _fast_loop()
    assert 1.0 <= bar.wall_s <= outside
    assert 0.0 < bar.thread_cpu_s < bar.wall_s
    assert bar.cpu_percent == 100 * bar.thread_cpu_s / bar.wall_s
    frames = [frame for frame in terminal.frames() if frame.startswith("step ")]
    assert 2 <= len(frames) <= outside / POLL_S + 2, len(frames)
    assert frames[-1].startswith("step 100/100") and "loss=3.0100" in frames[-1]
    assert any(not frame.startswith("step 100/") for frame in frames)  # it moved on the way


# The bar's documented cost is about 0.7% of one core over the default run (README.md; measured
# again by scripts/checks/check_claims.py). 5% is well above that and its noise on a quiet machine, and
# well below what a regression costs. A measurement: a loaded machine can fail it, so it runs
# with the benchmarks (-m bench), not in the suite.
CPU_PERCENT_BOUND = 5.0


@pytest.mark.bench
def test_the_bar_thread_costs_under_5_percent_of_one_core():
    bar, _, _ = _fast_loop()
    assert bar.cpu_percent < CPU_PERCENT_BOUND, f"{bar.cpu_percent:.2f}% of one core"


def test_phase_announces_its_start_and_time(caplog: pytest.LogCaptureFixture):
    logger = logging.getLogger("meshtrain.test")
    with (
        caplog.at_level(logging.INFO, logger="meshtrain.test"),
        phase(logger, "compiling the train step", "compiled the train step"),
    ):
        assert [r.getMessage() for r in caplog.records] == ["compiling the train step..."]
    assert re.fullmatch(r"compiled the train step in \d+\.\d s", caplog.records[-1].getMessage())
