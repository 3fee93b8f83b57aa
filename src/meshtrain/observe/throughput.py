"""Throughput metrics of a run: tokens/s per device, TFLOP/s per device, MFU, device memory and
the time the loop waited for data.

MFU = model FLOPs per second per device (meshtrain.flops) / the device's peak. The peak comes
from meshtrain.accelerators for known GPUs and TPUs, in the run's compute dtype. A CPU has no
published peak that means anything for a run sharing its cores among faked devices, so the peak
is measured at start-up: the best of a few matmuls run on every device at once. Any other device
gets no MFU rather than a wrong one.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.accelerators import accelerator_for_kind
from meshtrain.units import GIB

log = logging.getLogger(__name__)

# The benchmark matmul: [n, n] @ [n, n] on each device, best of `repeats` timed runs.
BENCHMARK_SIZE = 512
BENCHMARK_REPEATS = 5
_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@functools.cache
def measure_matmul_peak(
    devices: tuple[jax.Device, ...], compute_dtype: str, size: int = BENCHMARK_SIZE
) -> float:
    """FLOP/s per device of a [size, size] matmul running on all `devices` at once (they may
    share cores, as faked CPU devices do, so the rate is per device under that sharing).
    Measured once per process and set of devices."""
    mesh = Mesh(np.array(devices), ("devices",))
    sharding = NamedSharding(mesh, PartitionSpec("devices"))
    matmul = jax.jit(lambda a, b: jnp.einsum("dij,djk->dik", a, b), out_shardings=sharding)
    # Created in place, so that every process (of a multi-process run) only makes its shards.
    ones = jax.jit(
        lambda: jnp.ones((len(devices), size, size), _DTYPES[compute_dtype]),
        out_shardings=sharding,
    )
    x = ones()
    matmul(x, x).block_until_ready()  # compile and warm up
    best = float("inf")
    for _ in range(BENCHMARK_REPEATS):
        start = time.perf_counter()
        matmul(x, x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops_per_device(
    devices: Sequence[jax.Device], compute_dtype: str
) -> tuple[float | None, str]:
    """The peak FLOP/s per device MFU is measured against, and where it comes from."""
    device = devices[0]
    accelerator = accelerator_for_kind(device.device_kind)
    if accelerator is not None:
        return accelerator.peak(compute_dtype), f"{accelerator.description}, {compute_dtype} peak"
    if device.platform == "cpu":
        peak = measure_matmul_peak(tuple(devices), compute_dtype)
        return (
            peak,
            f"measured {BENCHMARK_SIZE}² {compute_dtype} matmul on {len(devices)} cpu device(s)",
        )
    return None, f"no peak known for device kind {device.device_kind!r}, so no MFU"


def memory_metrics(devices: Sequence[jax.Device]) -> dict[str, float]:
    """Memory in use and its peak (GiB, the largest over this process's devices), where the
    backend reports it; the CPU backend does not, so the keys are left out."""
    stats = [d.memory_stats() for d in devices if d.process_index == jax.process_index()]
    stats = [s for s in stats if s and "bytes_in_use" in s]
    if not stats:
        return {}
    metrics = {"memory_in_use_gib": max(s["bytes_in_use"] for s in stats) / GIB}
    if all("peak_bytes_in_use" in s for s in stats):
        metrics["memory_peak_gib"] = max(s["peak_bytes_in_use"] for s in stats) / GIB
    return metrics


class ThroughputMeter:
    """Turns step times into per-device throughput, FLOP/s and MFU, and times data waits."""

    def __init__(
        self,
        *,
        devices: Sequence[jax.Device],
        tokens_per_step: int,
        flops_per_step: float,
        peak_flops_per_device: float | None,
    ) -> None:
        self.devices = list(devices)
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = flops_per_step  # model FLOPs of one update, all devices
        self.peak = peak_flops_per_device
        self._data_wait = 0.0
        self._data_steps = 0

    @contextmanager
    def data_wait(self) -> Iterator[None]:
        """Times the loop's wait for the next batch: reading it and handing it to the devices."""
        start = time.perf_counter()
        yield
        self._data_wait += time.perf_counter() - start
        self._data_steps += 1

    def metrics(self, step_time_s: float) -> dict[str, float]:
        """Metrics of the steps since the last call, given their mean step time."""
        n = len(self.devices)
        flops_per_device = self.flops_per_step / n / step_time_s
        values = {
            "tokens_per_sec_per_device": self.tokens_per_step / step_time_s / n,
            "tflops_per_device": flops_per_device / 1e12,
        }
        if self.peak:
            values["mfu"] = flops_per_device / self.peak
        values["data_wait_s"] = self._data_wait / max(self._data_steps, 1)
        self._data_wait, self._data_steps = 0.0, 0
        values.update(memory_metrics(self.devices))
        return values
