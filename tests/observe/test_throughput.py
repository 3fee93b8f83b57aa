"""Throughput metrics: per-device rates, MFU against the right peak, memory, data wait."""

from types import SimpleNamespace

import jax
import pytest

from meshtrain.observe.throughput import ThroughputMeter, memory_metrics, peak_flops_per_device
from meshtrain.units import GIB


def fake_device(kind: str, platform: str = "gpu", stats=None):
    return SimpleNamespace(
        device_kind=kind, platform=platform, process_index=0, memory_stats=lambda: stats
    )


def test_meter_arithmetic():
    meter = ThroughputMeter(
        devices=jax.devices()[:4],
        tokens_per_step=8192,
        flops_per_step=4e12,
        peak_flops_per_device=2e12,
    )
    with meter.data_wait():
        pass
    values = meter.metrics(step_time_s=2.0)
    assert values["tokens_per_sec_per_device"] == 8192 / 2.0 / 4
    assert values["tflops_per_device"] == pytest.approx(0.5)  # 4e12 / 4 devices / 2 s
    assert values["mfu"] == pytest.approx(0.25)
    assert 0 <= values["data_wait_s"] < 0.1
    assert "memory_in_use_gib" not in values


def test_unknown_device_gets_no_mfu():
    peak, why = peak_flops_per_device([fake_device("NVIDIA GeForce RTX 4090")], "bf16")
    assert peak is None and "no peak known" in why
    meter = ThroughputMeter(
        devices=jax.devices()[:1], tokens_per_step=1, flops_per_step=1e9, peak_flops_per_device=peak
    )
    assert "mfu" not in meter.metrics(1.0)


def test_peaks_by_device_kind_and_precision():
    h100 = [fake_device("NVIDIA H100 80GB HBM3")]
    assert peak_flops_per_device(h100, "bf16")[0] == 989e12
    assert peak_flops_per_device(h100, "fp32")[0] == 495e12  # TF32 tensor cores
    v5e = [fake_device("TPU v5 lite", "tpu")]
    assert peak_flops_per_device(v5e, "fp32")[0] == 197e12  # fp32 matmuls run as bf16 passes


def test_cpu_peak_is_measured():
    peak, why = peak_flops_per_device(jax.devices(), "fp32")
    assert peak > 1e8 and "best fp32 matmul of this machine" in why
    assert "shared by 8 cpu device(s)" in why
    assert peak_flops_per_device(jax.devices(), "fp32")[0] == peak  # once per process


def test_memory_metrics():
    assert memory_metrics(jax.devices()) == {}  # the CPU backend reports nothing
    devices = [
        fake_device("x", stats={"bytes_in_use": 2 * GIB, "peak_bytes_in_use": 3 * GIB}),
        fake_device("x", stats={"bytes_in_use": 1 * GIB, "peak_bytes_in_use": 5 * GIB}),
    ]
    assert memory_metrics(devices) == {"memory_in_use_gib": 2.0, "memory_peak_gib": 5.0}
