"""Throughput metrics of a run: tokens/s per device, TFLOP/s per device, MFU, device memory and
the time the loop waited for data.

MFU = model FLOPs per second per device (meshtrain.observe.flops) / the device's peak. The peak
comes from meshtrain.hardware.accelerators for known GPUs and TPUs, in the run's compute dtype. A CPU has
no published peak that means anything, so its peak is measured: the best rate of a square matmul
in the compute dtype over sizes 256² up to at least 2048² (`measure_matmul_peak`), on one device,
which XLA runs on all the cores. That machine rate is measured once per machine and cached in
<cache root>/peak.json (`matmul_peak`), keyed by CPU model, core count, dtype and jax version;
the CPU devices on this host share it, so each gets its share. Any other device gets no MFU
rather than a wrong one.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from meshtrain.config.caches import cache_root
from meshtrain.hardware.accelerators import accelerator_for_kind
from meshtrain.observe.progress import phase
from meshtrain.units import GIB, format_flops

log = logging.getLogger(__name__)

# The peak matmuls: [n, n] @ [n, n] for n in PEAK_SIZES, in order. Every measurement reaches
# MIN_PEAK_SIZE; past it, the next size (8 times the work) is tried only while it is expected to
# take under MAX_MATMUL_S (a fast CPU or a GPU keeps going; a small CPU stops at 2048², after
# about a second in all).
PEAK_SIZES = (256, 512, 1024, 2048, 4096, 8192)
MIN_PEAK_SIZE = 2048
MAX_MATMUL_S = 0.5
PEAK_CACHE_FILE = "peak.json"
_TIMED_S = 0.1  # each size is timed over about this long (at least 2 runs), best run kept
_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
_CACHE_VERSION = 1
_memo: dict[str, dict[str, Any]] = {}  # cache key → entry, for this process


def _matmul_seconds(device: jax.Device, compute_dtype: str, size: int) -> float:
    """Best wall time of one [size, size] @ [size, size] matmul in `compute_dtype` on `device`.
    Its own one-device mesh: a run may measure inside the context of its whole mesh."""
    with jax.set_mesh(Mesh(np.array([device]), ("peak",))):
        return _best_matmul_seconds(SingleDeviceSharding(device), _DTYPES[compute_dtype], size)


def _best_matmul_seconds(sharding: SingleDeviceSharding, dtype: jnp.dtype, size: int) -> float:
    x = jax.jit(lambda: jnp.ones((size, size), dtype), out_shardings=sharding)()
    matmul = jax.jit(jnp.matmul)
    matmul(x, x).block_until_ready()  # compile and warm up

    def once() -> float:
        start = time.perf_counter()
        matmul(x, x).block_until_ready()
        return time.perf_counter() - start

    first = once()
    runs = max(1, min(20, int(_TIMED_S / max(first, 1e-6))))
    return min(first, *(once() for _ in range(runs)))


def measure_matmul_peak(
    device: jax.Device, compute_dtype: str, sizes: Sequence[int] = PEAK_SIZES
) -> dict[int, float]:
    """FLOP/s of a square matmul of each size measured on `device` (a CPU device uses all the
    machine's cores), up to at least MIN_PEAK_SIZE, and beyond it while the next size is
    expected to take under MAX_MATMUL_S. The peak is the best of them."""
    rates = {}
    for size, following in zip(sizes, (*sizes[1:], None), strict=True):
        seconds = _matmul_seconds(device, compute_dtype, size)
        rates[size] = 2 * size**3 / seconds
        expected = seconds * (following / size) ** 3 if following else float("inf")
        if size >= MIN_PEAK_SIZE and expected > MAX_MATMUL_S:
            break
    return rates


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def peak_cache_key(device: jax.Device, compute_dtype: str) -> str:
    """What a cached peak is valid for: the processor (CPU model and the cores this process may
    use; a GPU's or TPU's kind), the compute dtype and the jax version."""
    if device.platform == "cpu":
        hardware = f"cpu {_cpu_model()}, {_cores()} cores"
    else:
        hardware = f"{device.platform} {device.device_kind}"
    return f"{hardware} | {compute_dtype} | jax {jax.__version__}"


def peak_cache_path() -> Path:
    """<cache root>/peak.json: $MESHTRAIN_CACHE_DIR moves it (meshtrain.config.caches.cache_root)."""
    return cache_root() / PEAK_CACHE_FILE


def _read_cache(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _valid(entry: Any) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("flops_per_s"), int | float)


def _write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Adds or replaces one entry; written to a temporary file and renamed, so a reader never
    sees half a file. A cache that cannot be written costs a measurement next time, no more."""
    entries = _read_cache(path)
    entries[key] = entry
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": _CACHE_VERSION, "entries": entries}, indent=1))
        os.replace(tmp, path)
    except OSError as err:
        log.warning("could not cache the measured peak in %s: %s", path, err)


def matmul_peak(
    device: jax.Device, compute_dtype: str, *, refresh: bool = False, path: Path | None = None
) -> dict[str, Any]:
    """The best matmul rate of `device`'s processor in `compute_dtype`, as an entry
    {"flops_per_s", "size", "rates", "measured_at", "path"}.

    Read from the cache file (default <cache root>/peak.json) when it holds one for
    `peak_cache_key`, else measured (measure_matmul_peak) and cached. refresh=True always
    measures and returns this measurement; the file then keeps the higher of it and the cached
    one, so a measurement disturbed by other work on the machine never lowers the peak.
    """
    path = peak_cache_path() if path is None else path
    key = peak_cache_key(device, compute_dtype)
    memo_key = f"{path}|{key}"
    if not refresh:
        if memo_key in _memo:
            return _memo[memo_key]
        cached = _read_cache(path).get(key)
        if _valid(cached):
            _memo[memo_key] = {**cached, "path": str(path)}
            return _memo[memo_key]
    with phase(
        log,
        f"measuring this machine's {compute_dtype} matmul peak for MFU (once; cached in {path})",
        "measured the matmul peak",
    ):
        rates = measure_matmul_peak(device, compute_dtype)
    size = max(rates, key=rates.__getitem__)
    measured = {
        "flops_per_s": rates[size],
        "size": size,
        "rates": {str(n): rate for n, rate in rates.items()},
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    cached = _read_cache(path).get(key)
    kept = (
        cached if _valid(cached) and cached["flops_per_s"] > measured["flops_per_s"] else measured
    )
    _write_cache(path, key, kept)
    _memo[memo_key] = {**kept, "path": str(path)}
    return {**measured, "path": str(path)} if refresh else _memo[memo_key]


def _devices_sharing_this_host(
    devices: Sequence[jax.Device], hosts: Sequence[str] | None
) -> list[jax.Device]:
    """The devices in `devices` that run on this host: this process's, and those of other
    processes on the same machine (they all share its cores). `hosts`: each process's host
    name, by process index (meshtrain.distributed.runtime.process_hosts); None: one process."""
    me = jax.process_index()
    if not hosts:
        return [d for d in devices if d.process_index == me]
    return [d for d in devices if hosts[d.process_index] == hosts[me]]


def peak_flops_per_device(
    devices: Sequence[jax.Device],
    compute_dtype: str,
    *,
    hosts: Sequence[str] | None = None,
    refresh: bool = False,
) -> tuple[float | None, str]:
    """The peak FLOP/s per device MFU is measured against, and where it comes from.

    A CPU's is the machine's matmul peak (matmul_peak: cached, or measured now with refresh)
    divided among the devices on this host, which share its cores."""
    device = devices[0]
    accelerator = accelerator_for_kind(device.device_kind)
    if accelerator is not None:
        return accelerator.peak(compute_dtype), f"{accelerator.description}, {compute_dtype} peak"
    if device.platform == "cpu":
        local = next(d for d in devices if d.process_index == jax.process_index())
        entry = matmul_peak(local, compute_dtype, refresh=refresh)
        sharing = len(_devices_sharing_this_host(devices, hosts))
        origin = "measured now" if refresh else f"measured {entry['measured_at'][:10]}"
        return entry["flops_per_s"] / sharing, (
            f"best {compute_dtype} matmul of this machine, {format_flops(entry['flops_per_s'], '/s')} "
            f"at {entry['size']}² on {_cores()} cores ({origin}, cached in {entry['path']}), "
            f"shared by {sharing} cpu device(s)"
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
