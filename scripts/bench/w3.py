"""W3: the default `python run_training.py`, from launch to the end of step 1, cold and warm."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    _CACHE_ENV,
    REPO,
    progress,
)
from meshtrain.distributed.xla_flags import (  # the standard library only: JAX is not loaded
    without_fake_device_count,
)

_STEP1 = re.compile(r"step 1/\d+ ")
_MILESTONES = {
    "first_log_line": re.compile(r" INFO "),
    "data_ready": re.compile(r"data: \d+ training sequences"),
    "train_step_compiled": re.compile(r"compiled the train step"),
    "peak_known": re.compile(r"MFU against|MFU: "),
    "step_1_done": _STEP1,
}


def w3_env(cache_root: Path) -> dict[str, str]:
    """The caller's environment with meshtrain's caches in `cache_root` and no JAX cache
    settings of its own (the run's defaults apply), on one device."""
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_ENV}
    flags = without_fake_device_count(env.get("XLA_FLAGS", ""))
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env["MESHTRAIN_CACHE_DIR"] = str(cache_root)
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def launch_to_step_1(
    cache_root: Path, run_dir: Path, overrides: Sequence[str] = (), timeout_s: float = 600
) -> dict[str, Any]:
    """Seconds from starting `python run_training.py` to its step-1 line (the process is then
    stopped), with the times of the milestones on the way and the step-1 metrics."""
    command = [sys.executable, "run_training.py", f"hydra.run.dir={run_dir}", *overrides]
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=w3_env(cache_root),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    milestones: dict[str, float] = {}
    lines: list[str] = []
    try:
        for line in proc.stdout:
            now = time.perf_counter() - start
            lines.append(line.rstrip())
            for name, pattern in _MILESTONES.items():
                if name not in milestones and pattern.search(line):
                    milestones[name] = round(now, 2)
            if "step_1_done" in milestones or now > timeout_s:
                break
    finally:
        proc.kill()
        proc.wait()
    if "step_1_done" not in milestones:
        tail = "\n".join(lines[-20:])
        raise SystemExit(f"benchmark: W3 launch never logged step 1:\n{tail}")
    step_line = next(line for line in lines if _STEP1.search(line))
    compile_line = next((line for line in lines if "compiled the train step" in line), "")
    peak_line = next((line for line in lines if "MFU against" in line), "")
    return {
        "seconds": milestones["step_1_done"],
        "milestones_s": milestones,
        "step_1": _metrics_of(step_line),
        "compile_s": _number(r"compiled the train step in ([\d.]+) s", compile_line),
        "peak_tflops": _flops(r"MFU against ([\d.]+ [KMGTP]?FLOP)/s", peak_line),
    }


def _number(pattern: str, line: str) -> float | None:
    match = re.search(pattern, line)
    return float(match.group(1).replace(",", "")) if match else None


def _flops(pattern: str, line: str) -> float | None:
    match = re.search(pattern, line)
    if not match:
        return None
    value, unit = match.group(1).split()
    scale = {"FLOP": 1, "MFLOP": 1e6, "GFLOP": 1e9, "TFLOP": 1e12, "PFLOP": 1e15}[unit]
    return float(value) * scale / 1e12


def _metrics_of(line: str) -> dict[str, float]:
    return {
        key: value
        for key, value in {
            "step_time_s": _number(r"step_time=([\d.]+)s", line),
            "tokens_per_sec": _number(r" tokens/s=([\d,.]+)", line),
            "tflops_per_device": _number(r"TFLOP/s/device=([\d.e+-]+)", line),
            "mfu": (_number(r"mfu=([\d.]+)%", line) or 0) / 100 or None,
        }.items()
        if value is not None
    }


def run_w3(overrides: list[str]) -> dict[str, Any]:
    """Two launches of the default command (with `overrides`, to measure a lever) sharing one
    fresh cache directory: cold, then warm."""
    launched = shlex.join(["python", "run_training.py", *overrides])
    with tempfile.TemporaryDirectory(prefix="meshtrain-w3-") as tmp:
        root = Path(tmp)
        progress(f"W3: cold launch of `{launched}` (empty caches)")
        cold = launch_to_step_1(root / "cache", root / "run-cold", overrides)
        progress(f"W3: cold {cold['seconds']:.1f} s; warm launch (same cache directory)")
        warm = launch_to_step_1(root / "cache", root / "run-warm", overrides)
        progress(f"W3: warm {warm['seconds']:.1f} s")
    return {
        "workload": "W3",
        "cold_s": cold["seconds"],
        "warm_s": warm["seconds"],
        "cold_milestones_s": cold["milestones_s"],
        "warm_milestones_s": warm["milestones_s"],
        "cold_compile_s": cold["compile_s"],
        # The usual keys, from the warm launch's step 1 (one step: a rough figure).
        **warm["step_1"],
        "compile_s": warm["compile_s"],
        "peak_tflops": warm["peak_tflops"],
        "launched": launched,
    }
