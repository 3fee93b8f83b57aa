"""Metric sinks for a run: train.log, console log and progress bar, metrics.jsonl, and the
experiment trackers of logging.trackers (TensorBoard by default; observe.trackers).

Only process 0 writes train.log, metrics.jsonl and the trackers; another process N logs to
rank<N>.log and prints only warnings and errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from meshtrain.config.trackers import LoggingConfig
from meshtrain.observe.progress import ProgressBar
from meshtrain.observe.trackers import close_trackers, open_trackers
from meshtrain.observe.trackers.run_info import RunInfo, metric_tag, run_name
from meshtrain.units import format_eta

if TYPE_CHECKING:
    import jax

    from meshtrain.config.schema import Config

logger = logging.getLogger(__name__)

_ROOT_LOGGER = "meshtrain"
_CONSOLE_HANDLER = "meshtrain-console"
_FILE_HANDLER = "meshtrain-file"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Metric name → (label, format) in the log line; names not listed use `_default_display`.
_DISPLAY: dict[str, tuple[str, str]] = {
    "learning_rate": ("lr", "{:.2e}"),
    "grad_norm": ("grad_norm", "{:.2f}"),
    "tokens_per_sec": ("tokens/s", "{:,.0f}"),
    "step_time_s": ("step_time", "{:.3f}s"),
    "tokens_per_sec_per_device": ("tokens/s/device", "{:,.0f}"),
    "tflops_per_device": ("TFLOP/s/device", "{:.3g}"),
    "mfu": ("mfu", "{:.1%}"),
    "data_wait_s": ("data_wait", "{:.4f}s"),
    "memory_in_use_gib": ("mem", "{:.2f}GiB"),
    "memory_peak_gib": ("mem_peak", "{:.2f}GiB"),
}


class _ConsoleHandler(logging.StreamHandler):
    """Console handler; while a progress bar is shown, its lines go above the bar."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)
        self.tty = self.stream.isatty()
        self.bar: ProgressBar | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.bar is None:
            super().emit(record)
            return
        try:
            self.bar.print(self.format(record))
        except Exception:
            self.handleError(record)


def setup_logging(
    run_dir: Path | None, *, is_main: bool, level: int = logging.INFO, rank: int = 0
) -> None:
    """Send the "meshtrain" loggers to the console and to run_dir/train.log (process 0) or
    run_dir/rank<rank>.log (the others, whose console shows only warnings and errors).

    Replaces the handlers of a previous call, so repeated runs in one process (Hydra multirun,
    tests) neither duplicate console lines nor keep writing into an earlier run's train.log.
    """
    root = logging.getLogger(_ROOT_LOGGER)
    for handler in list(root.handlers):
        if handler.name in (_CONSOLE_HANDLER, _FILE_HANDLER):
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    # Hydra's handlers on the root logger would print every line a second time.
    root.propagate = False

    console = _ConsoleHandler()
    console.name = _CONSOLE_HANDLER
    console.setLevel(level if is_main else max(level, logging.WARNING))
    console.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(console)
    if run_dir is not None:
        name = "train.log" if is_main else f"rank{rank}.log"
        file = logging.FileHandler(Path(run_dir) / name, encoding="utf-8")
        file.name = _FILE_HANDLER
        file.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(file)


def _format_metric(name: str, value: float) -> str:
    label, fmt = _DISPLAY.get(name) or (name, "{:.4f}" if name.endswith("loss") else "{:.4g}")
    return f"{label}={fmt.format(value)}"


def _console_handler() -> _ConsoleHandler | None:
    for handler in logging.getLogger(_ROOT_LOGGER).handlers:
        if isinstance(handler, _ConsoleHandler):
            return handler
    return None


def _truncate_jsonl(path: Path, *, last_step: int) -> None:
    """Keep only the lines of `path` for steps <= last_step, replacing the file atomically.

    Lines that do not parse (the partial last line of a killed process) are dropped too.
    """
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and step <= last_step:
            kept.append(line + "\n")
    staged = path.with_name(path.name + ".tmp")
    staged.write_text("".join(kept), encoding="utf-8")
    os.replace(staged, path)


class MetricsWriter:
    """Writes each logged step to metrics.jsonl, the trackers and the log; on a terminal, it
    also shows every step finishing on a progress bar (observe.progress).

    `config`: the run's resolved config, whose logging.trackers are opened (with its
    experiment.name in the run's name, and the whole config logged to each); None: TensorBoard
    alone, without the config.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        is_main: bool,
        start_step: int = 0,
        tokens_per_step: int = 0,
        config: Config | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.is_main = is_main
        self._first: tuple[float, int] | None = None
        self._bar: ProgressBar | None = None
        if not is_main:
            return
        run_dir = Path(run_dir)
        # A run resumed at start_step in the same directory continues the earlier attempt's
        # history: steps after start_step were trained again from the checkpoint, so their old
        # lines and TensorBoard events go, and each step appears once. train.log keeps them all.
        jsonl_path = run_dir / "metrics.jsonl"
        _truncate_jsonl(jsonl_path, last_step=start_step)
        experiment = config.experiment.name if config is not None else run_dir.name
        run = RunInfo(
            run_dir=run_dir,
            name=run_name(run_dir, experiment),
            experiment=experiment,
            start_step=start_step,
            config=dataclasses.asdict(config) if config is not None else {},
        )
        settings = config.logging if config is not None else LoggingConfig()
        self._trackers = open_trackers(settings, run)  # before the jsonl: a failure leaves none
        self._jsonl = jsonl_path.open("a", encoding="utf-8")
        self._closed = False
        console = _console_handler()
        if console is not None and console.tty:
            self._bar = ProgressBar(
                console.stream,
                total_steps=total_steps,
                start_step=start_step,
                tokens_per_step=tokens_per_step,
            )
            console.bar = self._bar

    def dispatched(self, step: int, loss: jax.Array) -> None:
        """Step `step` is on its way; the progress bar moves when `loss` is ready."""
        if self._bar is not None:
            self._bar.dispatched(step, loss)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.is_main:
            return
        values = {name: float(value) for name, value in metrics.items()}
        self._jsonl.write(json.dumps({"step": int(step), **values}) + "\n")
        self._jsonl.flush()
        tagged = {metric_tag(name): value for name, value in values.items()}
        for tracker in list(self._trackers):
            try:
                tracker.write(int(step), tagged)
            except Exception as err:  # a tracker's service went away: training goes on
                self._trackers.remove(tracker)
                logger.warning(
                    "%s failed at step %d and is closed for the rest of the run (%s); "
                    "metrics.jsonl and the other trackers go on",
                    type(tracker).__name__,
                    step,
                    " ".join(str(err).split()) or type(err).__name__,
                )
                with contextlib.suppress(Exception):
                    tracker.close(failed=True)

        eta = self._eta(step)
        shown = " ".join(_format_metric(name, value) for name, value in values.items())
        logger.info("step %d/%d %s eta=%s", step, self.total_steps, shown, eta)

    def _eta(self, step: int) -> str:
        """The time left at the pace of the steps since the first write: the first logged
        step's own time holds warm-up, so it gives no estimate ("?")."""
        now = time.monotonic()
        if self._first is None:
            self._first = (now, step)
            return "?"
        since, done = self._first[0], step - self._first[1]
        if done <= 0 or now <= since:
            return "?"
        return format_eta((now - since) / done * max(self.total_steps - step, 0))

    def close(self, *, failed: bool = False) -> None:
        """Closes the sinks; `failed`: the run raised (the trackers mark their runs failed)."""
        if not self.is_main or self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            console = _console_handler()
            if console is not None:
                console.bar = None
        self._jsonl.close()
        close_trackers(self._trackers, failed=failed)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc_type is not None)
