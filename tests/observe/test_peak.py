"""The honest CPU peak: the best matmul rate over sizes up to at least 2048², measured once per
machine and cached by processor, dtype and jax version; the timed matmul is faked here."""

import json
import logging
import re

import jax
import pytest

from meshtrain.observe import throughput
from meshtrain.observe.throughput import (
    MAX_MATMUL_S,
    MIN_PEAK_SIZE,
    matmul_peak,
    measure_matmul_peak,
    peak_cache_key,
    peak_flops_per_device,
)

GFLOP = 1e9


class FakeMatmul:
    """Stands in for the timed matmul: `rates[size]` FLOP/s, counting the sizes it timed."""

    def __init__(self, rates: dict[int, float]) -> None:
        self.rates = rates
        self.timed: list[tuple[str, int]] = []

    def __call__(self, device, compute_dtype: str, size: int) -> float:
        self.timed.append((compute_dtype, size))
        return 2 * size**3 / self.rates.get(size, 10 * GFLOP)


@pytest.fixture
def fake(monkeypatch):
    # The 512² rate (the old peak) is below the larger sizes', as on a real CPU.
    matmul = FakeMatmul({256: 40 * GFLOP, 512: 80 * GFLOP, 1024: 120 * GFLOP, 2048: 130 * GFLOP})
    monkeypatch.setattr(throughput, "_matmul_seconds", matmul)
    monkeypatch.setattr(throughput, "_memo", {})  # a fresh process
    return matmul


def test_the_peak_is_the_best_size_and_at_least_the_512_rate(fake):
    rates = measure_matmul_peak(jax.devices()[0], "fp32")
    assert max(rates) >= MIN_PEAK_SIZE == 2048
    assert max(rates.values()) == rates[2048] == 130 * GFLOP
    assert max(rates.values()) >= rates[512]


def test_larger_sizes_only_while_a_matmul_stays_quick(fake):
    # 2048² at 130 GFLOP/s takes 0.13 s, so 4096² would take about 1 s: past MAX_MATMUL_S.
    assert 8 * 2 * 2048**3 / (130 * GFLOP) > MAX_MATMUL_S
    assert list(measure_matmul_peak(jax.devices()[0], "fp32")) == [256, 512, 1024, 2048]
    fake.rates[2048] = fake.rates[4096] = 2000 * GFLOP  # a fast machine: 8192² would take 0.5 s+
    assert list(measure_matmul_peak(jax.devices()[0], "fp32")) == [256, 512, 1024, 2048, 4096]
    fake.rates[256] = 1  # a slow small size never stops the climb to 2048²
    assert max(measure_matmul_peak(jax.devices()[0], "fp32")) >= MIN_PEAK_SIZE


def test_the_cached_value_is_reused_without_a_second_measurement(fake, tmp_path, monkeypatch):
    path = tmp_path / "peak.json"
    device = jax.devices()[0]
    first = matmul_peak(device, "fp32", path=path)
    assert first["flops_per_s"] == 130 * GFLOP and first["size"] == 2048
    measured = len(fake.timed)
    assert measured >= 4
    assert matmul_peak(device, "fp32", path=path)["flops_per_s"] == 130 * GFLOP  # this process
    monkeypatch.setattr(throughput, "_memo", {})  # the next process: read from the file
    assert matmul_peak(device, "fp32", path=path)["flops_per_s"] == 130 * GFLOP
    assert len(fake.timed) == measured
    entries = json.loads(path.read_text())["entries"]
    assert list(entries) == [peak_cache_key(device, "fp32")]


def test_the_key_changes_with_the_dtype(fake, tmp_path):
    device = jax.devices()[0]
    fp32, bf16 = peak_cache_key(device, "fp32"), peak_cache_key(device, "bf16")
    assert fp32 != bf16
    assert "fp32" in fp32 and f"jax {jax.__version__}" in fp32 and "cores" in fp32
    path = tmp_path / "peak.json"
    matmul_peak(device, "fp32", path=path)
    matmul_peak(device, "bf16", path=path)  # measured, not the fp32 value
    assert {dtype for dtype, _ in fake.timed} == {"fp32", "bf16"}
    assert set(json.loads(path.read_text())["entries"]) == {fp32, bf16}


def test_a_refresh_reports_its_measurement_and_the_cache_keeps_the_best(fake, tmp_path):
    device, path = jax.devices()[0], tmp_path / "peak.json"
    matmul_peak(device, "fp32", path=path)  # 130 GFLOP/s cached
    fake.rates = {size: 50 * GFLOP for size in fake.rates}  # a busy machine
    assert matmul_peak(device, "fp32", path=path, refresh=True)["flops_per_s"] == 50 * GFLOP
    assert matmul_peak(device, "fp32", path=path)["flops_per_s"] == 130 * GFLOP
    fake.rates = {size: 200 * GFLOP for size in fake.rates}  # a quiet one
    matmul_peak(device, "fp32", path=path, refresh=True)
    cached = json.loads(path.read_text())["entries"][peak_cache_key(device, "fp32")]
    assert cached["flops_per_s"] == 200 * GFLOP


def test_a_broken_cache_file_is_measured_again(fake, tmp_path):
    path = tmp_path / "peak.json"
    path.write_text("{not json")
    assert matmul_peak(jax.devices()[0], "fp32", path=path)["flops_per_s"] == 130 * GFLOP
    assert json.loads(path.read_text())["version"] == 1


def test_cpu_devices_share_the_machine_peak(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path))
    devices = jax.devices()  # 8 faked CPU devices on this machine's cores
    peak, source = peak_flops_per_device(devices, "fp32")
    assert peak == pytest.approx(130 * GFLOP / len(devices))
    assert "best fp32 matmul" in source and "2048²" in source
    assert f"shared by {len(devices)} cpu device(s)" in source
    assert str(tmp_path / "peak.json") in source
    assert peak_flops_per_device(devices[:1], "fp32")[0] == pytest.approx(130 * GFLOP)


@pytest.fixture
def peak_log():
    """The INFO lines of meshtrain.observe.throughput, caught by a handler of its own (a run's
    setup_logging may stop the "meshtrain" loggers from reaching pytest's caplog)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    level = throughput.log.level
    throughput.log.addHandler(handler)
    throughput.log.setLevel(logging.INFO)
    yield lines
    throughput.log.removeHandler(handler)
    throughput.log.setLevel(level)


def test_start_up_announces_the_peak_measurement_only_when_the_cache_is_cold(
    fake, tmp_path, monkeypatch, peak_log
):
    """What a run's start-up calls (peak_flops_per_device) with an empty MESHTRAIN_CACHE_DIR:
    the phase line before the 1-2 s of matmuls, then its time; with peak.json there, silence."""
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path))
    device = jax.devices()[:1]
    peak, _ = peak_flops_per_device(device, "fp32")
    assert peak == 130 * GFLOP
    path = tmp_path / "peak.json"
    assert peak_log[0] == (
        f"measuring this machine's fp32 matmul peak for MFU (once; cached in {path})..."
    )
    assert re.fullmatch(r"measured the matmul peak in \d+\.\d s", peak_log[1]), peak_log
    assert len(peak_log) == 2 and path.is_file()
    timed = len(fake.timed)
    assert timed == 4  # 256² to 2048², measured once
    peak_log.clear()
    monkeypatch.setattr(throughput, "_memo", {})  # the next launch: the cache is warm
    assert peak_flops_per_device(device, "fp32")[0] == 130 * GFLOP
    assert peak_log == [] and len(fake.timed) == timed
    fake.rates[2048] = 140 * GFLOP  # refresh=True measures (and says so) even with a warm cache
    assert peak_flops_per_device(device, "fp32", refresh=True)[0] == 140 * GFLOP
    assert peak_log[0].startswith("measuring this machine's fp32 matmul peak")


def test_a_real_measurement_is_positive_and_the_best_of_its_sizes(monkeypatch):
    monkeypatch.setattr(throughput, "_memo", {})
    rates = measure_matmul_peak(jax.devices()[0], "fp32", sizes=(64, 128))
    assert set(rates) == {64, 128} and all(rate > 0 for rate in rates.values())
