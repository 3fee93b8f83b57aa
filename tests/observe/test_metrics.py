"""Tests for the metric sinks: metrics.jsonl, train.log, TensorBoard events, console, ETA."""

from __future__ import annotations

import io
import json
import logging
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.observe import metrics
from meshtrain.observe.metrics import MetricsWriter, setup_logging
from meshtrain.observe.trackers.tensorboard import import_summary_writer

# tensorboardX's package imports torch where it is installed; meshtrain loads it without (and so
# must the default tests: tests/conftest.py checks that they import no torch).
import_summary_writer()
from tensorboardX.proto.event_pb2 import Event, SessionLog  # noqa: E402
from tensorboardX.record_writer import masked_crc32c  # noqa: E402

STEP_METRICS = {
    "loss": 4.123449,
    "learning_rate": 3e-3,
    "grad_norm": np.float32(1.2345),
    "tokens_per_sec": 12345.4,
    "step_time_s": 0.0521,
}


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    # Handlers hold this test's stdout and tmp files; later tests must not inherit them.
    yield
    root = logging.getLogger("meshtrain")
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.propagate = True
    root.setLevel(logging.NOTSET)


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _FakeClock:
    fake = _FakeClock()
    monkeypatch.setattr(metrics.time, "monotonic", fake)
    return fake


def _read_events(path: Path) -> Iterator[Event]:
    """Parse the TFRecord-framed Event protos of one event file, checking the CRCs."""
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        body = data[pos + 12 : pos + 12 + length]
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        assert header_crc == masked_crc32c(header)
        assert body_crc == masked_crc32c(body)
        pos += 16 + length
        yield Event.FromString(body)


def _read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag → (step, value) of the run's one event file."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    (path,) = run_dir.glob("events.out.tfevents.*")
    for event in _read_events(path):
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_metrics_jsonl_has_one_exact_line_per_step(tmp_path: Path) -> None:
    written = {
        1: {"loss": 5.5, "learning_rate": 1e-4, "tokens_per_sec": np.float32(1000.5)},
        2: {"loss": np.float64(5.25), "learning_rate": 2e-4, "tokens_per_sec": 1001},
        10: {"loss": 4.123449, "learning_rate": 3e-3, "tokens_per_sec": 999.75},
    }
    with MetricsWriter(tmp_path, total_steps=300, is_main=True) as writer:
        for count, (step, values) in enumerate(written.items(), start=1):
            writer.write(step, values)
            # Flushed per write: a killed run keeps every line written so far.
            assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == count

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "loss": 5.5, "learning_rate": 1e-4, "tokens_per_sec": 1000.5},
        {"step": 2, "loss": 5.25, "learning_rate": 2e-4, "tokens_per_sec": 1001.0},
        {"step": 10, "loss": 4.123449, "learning_rate": 3e-3, "tokens_per_sec": 999.75},
    ]
    assert list(json.loads(lines[0])) == ["step", "loss", "learning_rate", "tokens_per_sec"]
    assert isinstance(json.loads(lines[1])["tokens_per_sec"], float)


def test_resumed_writer_replaces_the_steps_after_its_start(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, total_steps=5, is_main=True) as writer:
        for step in range(1, 6):
            writer.write(step, {"loss": float(step)})
    with (tmp_path / "metrics.jsonl").open("a") as jsonl:
        jsonl.write('{"step": 6, "lo')  # the partial line of a killed process
    (first_events,) = tmp_path.glob("events.out.tfevents.*")

    # Resumed from the checkpoint of step 3: steps 4 and 5 are trained and logged again.
    with MetricsWriter(tmp_path, total_steps=5, is_main=True, start_step=3) as writer:
        for step in (4, 5):
            writer.write(step, {"loss": step + 0.5})

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": 3.0},
        {"step": 4, "loss": 4.5},
        {"step": 5, "loss": 5.5},
    ]
    assert [path.name for path in tmp_path.iterdir() if path.suffix == ".tmp"] == []
    # TensorBoard hides the first attempt's events from step 4 on: the new event file starts
    # with a session START at step 4, which purges them.
    (second_events,) = set(tmp_path.glob("events.out.tfevents.*")) - {first_events}
    events = list(_read_events(second_events))
    starts = [event.step for event in events if event.session_log.status == SessionLog.START]
    assert starts == [4]
    logged = [(event.step, value.simple_value) for event in events for value in event.summary.value]
    assert logged == [(4, 4.5), (5, 5.5)]


def test_train_log_has_formatted_step_line(tmp_path: Path, clock: _FakeClock) -> None:
    setup_logging(tmp_path, is_main=True)
    with MetricsWriter(tmp_path, total_steps=300, is_main=True) as writer:
        writer.write(10, STEP_METRICS)
        clock.now = 29.0
        writer.write(20, STEP_METRICS)  # 10 steps in 29 s → 280 × 2.9 s

    log = (tmp_path / "train.log").read_text().splitlines()[-1]
    expected = (
        "INFO meshtrain.observe.metrics: step 20/300 loss=4.1234 lr=3.00e-03 grad_norm=1.23 "
        "tokens/s=12,345 step_time=0.052s eta=13m32s"
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} " + re.escape(expected), log), log


def test_tensorboard_scalars_round_trip(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, total_steps=300, is_main=True) as writer:
        writer.write(1, {"loss": 5.5, "learning_rate": 0.25})
        writer.write(2, {"loss": np.float32(4.75), "learning_rate": 0.5})
        writer.write(10, {"loss": 3.125, "learning_rate": 0.5, "val_loss": 3.5})

    scalars = _read_scalars(tmp_path)
    assert scalars == {
        "train/loss": [(1, 5.5), (2, 4.75), (10, 3.125)],
        "train/learning_rate": [(1, 0.25), (2, 0.5), (10, 0.5)],
        "val/loss": [(10, 3.5)],
    }


def test_non_main_process_writes_only_its_rank_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging(tmp_path, is_main=False, rank=3)
    with MetricsWriter(tmp_path, total_steps=300, is_main=False) as writer:
        writer.write(1, STEP_METRICS)
    log = logging.getLogger("meshtrain.train.loop")
    log.info("hidden info")
    log.warning("shown warning")

    assert [path.name for path in tmp_path.iterdir()] == ["rank3.log"]
    logged = (tmp_path / "rank3.log").read_text()
    assert "hidden info" in logged and "shown warning" in logged
    assert "step 1/300" not in logged
    out = capsys.readouterr().out
    assert "hidden info" not in out
    assert "step 1/300" not in out
    assert out.count("shown warning") == 1


def test_setup_logging_twice_switches_file_without_duplicating_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = logging.getLogger("meshtrain.train.loop")
    first, second = tmp_path / "run0", tmp_path / "run1"
    first.mkdir()
    second.mkdir()

    setup_logging(first, is_main=True)
    log.info("first run")
    setup_logging(second, is_main=True)
    log.info("second run")

    assert "first run" in (first / "train.log").read_text()
    assert "second run" not in (first / "train.log").read_text()
    assert "first run" not in (second / "train.log").read_text()
    assert "second run" in (second / "train.log").read_text()
    out = capsys.readouterr().out
    assert out.count("first run") == 1
    assert out.count("second run") == 1


def test_console_without_tty_has_only_log_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging(tmp_path, is_main=True)
    with MetricsWriter(tmp_path, total_steps=300, is_main=True) as writer:
        writer.write(10, STEP_METRICS)
        writer.write(20, STEP_METRICS)

    out = capsys.readouterr().out
    assert "\r" not in out
    assert "[" not in out
    lines = out.splitlines()
    assert len(lines) == 2
    assert "step 20/300 loss=4.1234" in lines[1]


class _TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_log_lines_go_above_the_live_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = _TtyStream()
    monkeypatch.setattr("sys.stdout", stream)
    setup_logging(tmp_path, is_main=True)
    with MetricsWriter(tmp_path, total_steps=100, is_main=True, tokens_per_step=64) as writer:
        writer.dispatched(50, jnp.float32(2.0))  # a finished step: the bar shows it
        writer.write(50, {"loss": 2.0, "tokens_per_sec": 1234.0})
        logging.getLogger("meshtrain.train.loop").info("saved checkpoint")
    assert metrics._console_handler().bar is None  # closed with the writer
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", stream.getvalue())
    frames = [re.sub(r"\d\d:\d\d:\d\d", "T", f) for f in re.split(r"[\r\n]", text) if f.strip()]
    assert (
        "T INFO meshtrain.observe.metrics: step 50/100 loss=2.0000 tokens/s=1,234 eta=?" in frames
    )
    assert "T INFO meshtrain.train.loop: saved checkpoint" in frames
    assert frames[-1].startswith("step 50/100 ") and "loss=2.0000" in frames[-1]


def test_eta_uses_steps_since_first_write_and_start_step(
    tmp_path: Path, clock: _FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="meshtrain.observe.metrics")
    with MetricsWriter(tmp_path, total_steps=300, is_main=True, start_step=100) as writer:
        clock.now = 20.0
        writer.write(110, {"loss": 1.0})  # its steps hold the first one's warm-up: no estimate
        clock.now = 25.0
        writer.write(120, {"loss": 1.0})  # 10 steps in 5 s since the first write → 180 × 0.5 s
        clock.now = 35.0
        writer.write(130, {"loss": 1.0})  # 20 steps in 15 s → 170 × 0.75 s
    etas = [record.getMessage().rsplit("eta=", 1)[1] for record in caplog.records]
    assert etas == ["?", "1m30s", "2m08s"]


def test_a_tracker_failing_mid_run_is_closed_and_the_rest_goes_on(tmp_path: Path, caplog) -> None:
    class Flaky:
        def __init__(self) -> None:
            self.steps, self.closed = [], []

        def write(self, step, values):
            if step == 2:
                raise ConnectionError("the server\nwent away")
            self.steps.append(step)

        def close(self, *, failed: bool) -> None:
            self.closed.append(failed)

    with MetricsWriter(tmp_path, total_steps=3, is_main=True) as writer:
        flaky = Flaky()
        writer._trackers.append(flaky)
        with caplog.at_level("WARNING", logger="meshtrain.observe.metrics"):
            for step in (1, 2, 3):
                writer.write(step, {"loss": float(step)})
    assert flaky.steps == [1] and flaky.closed == [True]  # closed once, as failed
    assert caplog.messages == [
        "Flaky failed at step 2 and is closed for the rest of the run (the server went away); "
        "metrics.jsonl and the other trackers go on"
    ]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
