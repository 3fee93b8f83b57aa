"""What every workload shares: the workloads' overrides and step counts, progress lines, the
machine/date/command stamp of a result, the children's environment, the config, the timing."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.distributed.xla_flags import (  # the standard library only: JAX is not loaded
    with_cpu_collective_timeouts,
    without_fake_device_count,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "configs"
WORKLOADS = ("W1", "W2", "W3", "W4", "W5")

_W1 = [
    "model.name=w1",
    "model.d_model=256",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.head_dim=64",
    "model.mlp_dim=1024",
    "model.vocab_size=32000",
    "model.tie_embeddings=false",
    "data=synthetic",
    "data.seq_len=256",
    "training.mixed_precision=fp32",
]
# W5: W1's shapes as a Qwen3-MoE (16 experts of width 256, 4 per token: W1's MLP width 1024 in
# active parameters) on 8 faked devices, experts over ep; W5-dense: the same model with a dense
# MLP of that width, the same devices over fsdp.
_W5 = [
    *[o for o in _W1 if not o.startswith("model.name")],
    "model.qk_norm=true",
    "training.global_batch_size=8",
]
OVERRIDES: dict[str, list[str]] = {
    "W1": [*_W1, 'model.mesh_shape=[[1,1],["fsdp","tp"]]', "training.micro_batch_size=4"],
    "W2": [*_W1, 'model.mesh_shape=[[4,2],["fsdp","tp"]]', "training.global_batch_size=4"],
    "W5": [
        *_W5,
        "model.name=w5",
        "model.family=qwen3_moe",
        "model.moe.num_experts=16",
        "model.moe.top_k=4",
        "model.moe.expert_dim=256",
        "model.moe.aux_loss_coef=0.001",
        'model.mesh_shape=[[2,4],["ep","fsdp"]]',
    ],
    "W5-dense": [
        *_W5,
        "model.name=w5_dense",
        "model.family=qwen3",
        'model.mesh_shape=[[8,1],["fsdp","tp"]]',
    ],
}
DEVICES = {"W1": 1, "W2": 8, "W5": 8}
W4_MODELS = ("llama3_1b", "gemma3_1b")
W4_SEQ_LEN = 4096
W4_MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# (warm-up steps, timed steps) per workload, normal and --quick.
STEPS = {"W1": (2, 20), "W2": (2, 10), "W4": (3, 20), "W5": (2, 10)}
QUICK_STEPS = {"W1": (1, 3), "W2": (1, 3), "W4": (2, 5), "W5": (1, 3)}
# The environment of JAX's persistent compilation cache, which the W3 launches must not inherit.
_CACHE_ENV = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_ENABLE_COMPILATION_CACHE",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
)


def progress(message: str) -> None:
    print(f"[benchmark] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Where and when: the machine, the date and the command of every result.


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page_size / 2**30


def machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = _memory_gib()
    ram = f", {memory:.0f} GiB RAM" if memory else ""
    return f"{_cpu_model()}, {cores} cores{ram}, {platform.system()} {platform.release()}"


# llama3_8b as the planners' rows compile it for H100s: micro-batch 1, bf16, full remat, scan.
LLAMA3_8B_ON_H100 = (
    "model=llama3_8b",
    "data=synthetic",
    "model.remat=full",
    "model.scan_layers=true",
    "training.micro_batch_size=1",
    "training.mixed_precision=bf16",
    "plan.target=h100",
)


def dry_run_plan(overrides: list[str]) -> tuple[dict[str, Any], str]:
    """`python run_training.py training.dry_run=true <overrides>` in a scratch run directory,
    on this machine's CPU (no faked device count): the plan.json it writes and its stdout; a
    failed run exits with the end of its stderr."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "run_training.py", *overrides, "training.dry_run=true"]
        command.append(f"hydra.run.dir={run_dir}")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        return json.loads((Path(run_dir) / "plan.json").read_text()), done.stdout


def write_results(path: str, results: list[dict[str, Any]], load_before: float) -> None:
    """The results of a run as JSON at `path`, with the machine, the date and the 1-minute load
    average at the start and at the end."""
    import json

    document = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "load_average_1min": [load_before, os.getloadavg()[0]],  # at the start, at the end
        "results": results,
    }
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


def stamp(result: dict[str, Any], argv: list[str], script: str = "benchmark.py") -> dict[str, Any]:
    """`result` with the machine, the date and the command (`python scripts/<script> <argv>`)."""
    return {
        **result,
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", f"scripts/{script}", *argv]),
    }


# ---------------------------------------------------------------------------------------------
# W1, W2, W4: one child process per workload.


def child_env(workload: str) -> dict[str, str]:
    """The child's environment: the caller's XLA_FLAGS without a device count, W1 and W2 on
    that many CPU devices (with long collective timeouts), and no persistent compilation cache
    (the compile is timed)."""
    env = dict(os.environ)
    flags = without_fake_device_count(env.get("XLA_FLAGS", ""))
    if workload in DEVICES:
        env["JAX_PLATFORMS"] = "cpu"
        count = f"--xla_force_host_platform_device_count={DEVICES[workload]}"
        # Faked devices: XLA's CPU collective timeouts raised, as every meshtrain launch does.
        flags = with_cpu_collective_timeouts(f"{flags} {count}")
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return env


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from meshtrain.config.hydra import register_configs, to_config

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_config(hydra_compose(config_name="config", overrides=overrides))


def peak_memory(devices) -> tuple[float, str]:
    """Peak memory (GiB) and what it is: the devices' peak where they report one, else the
    process's peak resident set (the CPU backend reports nothing)."""
    stats = [d.memory_stats() or {} for d in devices]
    if stats and all("peak_bytes_in_use" in s for s in stats):
        return max(s["peak_bytes_in_use"] for s in stats) / 2**30, "device peak_bytes_in_use"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib / 2**20, "process peak RSS"


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def steps_of(workload: str, args: argparse.Namespace) -> tuple[int, int]:
    """(warm-up steps, timed steps): --warmup and --steps, else the workload's (--quick) defaults."""
    warmup, timed = (QUICK_STEPS if args.quick else STEPS)[workload]
    return (warmup if args.warmup is None else args.warmup), (args.steps or timed)
