"""meshtrain's throughput benchmarks, W1 to W4 (docs/performance.md).

    python scripts/benchmark.py [--workload W1|W2|W3|W4 ...] [--json] [--quick] [--reference]

W1  Llama-style, untied embeddings, d_model 256, 2 layers, 4 heads of 64 (4 kv heads), MLP 1024,
    vocabulary 32000, sequence 256, batch 4, 1 CPU device, fp32.
W2  W1 on 8 faked CPU devices, mesh [[4,2],["fsdp","tp"]], global batch 4.
W3  the default `python run_training.py`, from launch to the end of step 1: cold (empty caches)
    and warm (the same cache directory, second launch).
W4  llama3_1b and gemma3_1b in bf16 at sequence 4096 on one GPU, at the micro-batch that fits
    best (GPU only).

Each of W1, W2 and W4 runs in a child process of its own (the device count is fixed when JAX
starts), builds the step as a run does (the config composed by Hydra from configs/, then
meshtrain.train.setup.prepare, compile_train_step and a fresh train state, batches from the
data pipeline), measures the device's matmul peak in the same run
(meshtrain.observe.throughput.matmul_peak) and times single steps: the median step time,
tokens/s, TFLOP/s per device and MFU (meshtrain.observe.flops.train_flops_per_step over the
measured peak), the compile time and the peak memory. JAX's persistent compilation cache is off
in those children, so the compile time is a real compile.

--reference (W1) also times a plain hand-written Flax NNX + optax loop of the same dimensions,
interleaved step by step with meshtrain's in the same process, and prints the ratio.
--json prints one JSON object per workload on stdout (progress goes to stderr); --save FILE
also writes them as one document (docs/benchmarks.json is one; compare a new run with
scripts/compare_benchmarks.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from meshtrain.distributed.xla_flags import (  # the standard library only: JAX is not loaded
    with_cpu_collective_timeouts,
    without_fake_device_count,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"
WORKLOADS = ("W1", "W2", "W3", "W4")

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
OVERRIDES: dict[str, list[str]] = {
    "W1": [*_W1, 'model.mesh_shape=[[1,1],["fsdp","tp"]]', "training.micro_batch_size=4"],
    "W2": [*_W1, 'model.mesh_shape=[[4,2],["fsdp","tp"]]', "training.global_batch_size=4"],
}
DEVICES = {"W1": 1, "W2": 8}
W4_MODELS = ("llama3_1b", "gemma3_1b")
W4_SEQ_LEN = 4096
W4_MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# (warm-up steps, timed steps) per workload, normal and --quick.
STEPS = {"W1": (2, 20), "W2": (2, 10), "W4": (3, 20)}
QUICK_STEPS = {"W1": (1, 3), "W2": (1, 3), "W4": (2, 5)}
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


def run_child(workload: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="meshtrain-benchmark-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", workload, "--child-out", str(out)]
        command += ["--quick"] if args.quick else []
        command += ["--reference"] if args.reference else []
        command += [f"--steps={args.steps}"] if args.steps else []
        command += [f"--warmup={args.warmup}"] if args.warmup is not None else []
        command += [f"--micro-batch={args.micro_batch}"] if args.micro_batch else []
        command += [f"--model={name}" for name in args.model]
        command += [f"--override={o}" for o in args.override]
        proc = subprocess.run(command, env=child_env(workload), cwd=REPO)
        if proc.returncode != 0 or not out.is_file():
            raise SystemExit(f"benchmark: {workload} failed (exit code {proc.returncode})")
        return json.loads(out.read_text())


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


class MeshtrainStep:
    """meshtrain's step for a config, built as `python run_training.py` builds it."""

    def __init__(self, cfg, devices) -> None:
        import jax

        from meshtrain.data import BatchIterator
        from meshtrain.train.batch import process_rows, to_global_array
        from meshtrain.train.optimizer import build_optimizer
        from meshtrain.train.setup import compile_train_step, prepare
        from meshtrain.train.state import create_train_state, state_shardings

        self.setup = setup = prepare(cfg, devices)
        tx = build_optimizer(cfg.training)
        shardings = state_shardings(setup.model, tx, setup.mesh)
        with jax.set_mesh(setup.mesh):
            start = time.perf_counter()
            self.compiled, batch_sharding = compile_train_step(setup, tx, shardings)
            self.compile_s = time.perf_counter() - start
            self.state = create_train_state(cfg.model, tx, shardings, cfg.training.seed)
        batches = BatchIterator(
            setup.train_data,
            global_batch=setup.global_batch,
            accum_steps=cfg.training.gradient_accumulation_steps,
            rows=process_rows(batch_sharding, setup.batch_shape, axis=1),
            seed=cfg.training.seed,
        )
        self._next_batch = lambda: to_global_array(next(batches), batch_sharding, setup.batch_shape)
        self._jax = jax

    def __call__(self) -> None:
        """One step as the loop runs it (next batch to the devices, the update), waited for."""
        with self._jax.set_mesh(self.setup.mesh):
            self.state, metrics = self.compiled(self.state, self._next_batch())
            self._jax.block_until_ready((self.state, metrics))

    def planned_memory_gib(self) -> float:
        analysis = self.compiled.memory_analysis()
        total = (
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes
        )
        return total / 2**30


class ReferenceStep:
    """The hand-written loop W1 is compared with: Flax NNX modules (nnx.Linear projections,
    nnx.RMSNorm, SwiGLU, tied embeddings, no RoPE), jax.nn.dot_product_attention(is_causal=True),
    optax.adamw and optax.softmax_cross_entropy_with_integer_labels, in one jax.jit."""

    def __init__(self, cfg, device, batch_size: int) -> None:
        import functools

        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax
        from flax import nnx

        m = cfg.model
        heads, kv_heads, head_dim = m.num_heads, m.num_kv_heads, m.head_dim

        class Block(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
                self.attn_norm = nnx.RMSNorm(m.d_model, rngs=rngs)
                self.q = linear(m.d_model, heads * head_dim)
                self.k = linear(m.d_model, kv_heads * head_dim)
                self.v = linear(m.d_model, kv_heads * head_dim)
                self.o = linear(heads * head_dim, m.d_model)
                self.mlp_norm = nnx.RMSNorm(m.d_model, rngs=rngs)
                self.gate = linear(m.d_model, m.mlp_dim)
                self.up = linear(m.d_model, m.mlp_dim)
                self.down = linear(m.mlp_dim, m.d_model)

            def __call__(self, x):
                b, t, _ = x.shape
                h = self.attn_norm(x)
                q = self.q(h).reshape(b, t, heads, head_dim)
                k = self.k(h).reshape(b, t, kv_heads, head_dim)
                v = self.v(h).reshape(b, t, kv_heads, head_dim)
                attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
                x = x + self.o(attended.reshape(b, t, heads * head_dim))
                h = self.mlp_norm(x)
                return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))

        class Model(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                self.embed = nnx.Embed(m.vocab_size, m.d_model, rngs=rngs)
                self.blocks = nnx.List([Block(rngs) for _ in range(m.num_layers)])
                self.norm = nnx.RMSNorm(m.d_model, rngs=rngs)

            def __call__(self, tokens):
                x = self.embed(tokens)
                for block in self.blocks:
                    x = block(x)
                return self.embed.attend(self.norm(x))

        t = cfg.training
        tx = optax.adamw(t.learning_rate, b1=t.adam_b1, b2=t.adam_b2, weight_decay=t.weight_decay)
        with jax.default_device(device):
            graphdef, params = nnx.split(Model(nnx.Rngs(t.seed)))
            opt_state = tx.init(params)

        def loss_fn(params, tokens):
            logits = nnx.merge(graphdef, params)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        start = time.perf_counter()
        tokens_shape = jax.ShapeDtypeStruct((batch_size, cfg.data.seq_len + 1), jnp.int32)
        self.compiled = step.lower(params, opt_state, tokens_shape).compile()
        self.compile_s = time.perf_counter() - start
        self.params, self.opt_state = params, opt_state
        rng = np.random.default_rng(t.seed)
        self._batch = lambda: jax.device_put(
            rng.integers(0, m.vocab_size, (batch_size, cfg.data.seq_len + 1), dtype=np.int32),
            device,
        )
        self._jax = jax

    def __call__(self) -> None:
        self.params, self.opt_state, loss = self.compiled(
            self.params, self.opt_state, self._batch()
        )
        self._jax.block_until_ready((self.params, self.opt_state, loss))


def measured_peak(devices, compute_dtype: str) -> dict[str, Any]:
    """This run's matmul peak per device (measured now; the cache keeps the best), and the
    published one where meshtrain knows the device."""
    import jax

    from meshtrain.accelerators import accelerator_for_kind
    from meshtrain.observe.throughput import matmul_peak

    local = [d for d in devices if d.process_index == jax.process_index()]
    entry = matmul_peak(local[0], compute_dtype, refresh=True)
    best_known = matmul_peak(local[0], compute_dtype)  # the cache: the best of every run here
    # CPU devices share one machine's cores; each GPU or TPU has its own.
    share = len(local) if local[0].platform == "cpu" else 1
    peak = {
        "peak_tflops": entry["flops_per_s"] / share / 1e12,
        "peak_source": f"best {compute_dtype} matmul measured in this run, at {entry['size']}²"
        + (f", shared by {share} cpu devices" if share > 1 else ""),
        "peak_rates_tflops": {n: r / share / 1e12 for n, r in entry["rates"].items()},
        "best_known_peak_tflops": best_known["flops_per_s"] / share / 1e12,
    }
    accelerator = accelerator_for_kind(local[0].device_kind)
    if accelerator is not None:
        peak["spec_peak_tflops"] = accelerator.peak(compute_dtype) / 1e12
    return peak


def summarise(
    times: list[float], tokens_per_step: int, flops_per_step: float, devices: int, peak: dict
) -> dict[str, Any]:
    step = statistics.median(times)
    tflops = flops_per_step / devices / step / 1e12
    result = {
        "steps_timed": len(times),
        "step_time_s": step,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "tokens_per_sec": tokens_per_step / step,
        "tflops_per_device": tflops,
        "mfu": tflops / peak["peak_tflops"],
        # Against the best peak measured on this machine so far (a busy machine reads low).
        "mfu_best_known_peak": tflops / peak["best_known_peak_tflops"],
        **peak,
    }
    if "spec_peak_tflops" in peak:
        result["mfu_spec"] = tflops / peak["spec_peak_tflops"]
    return result


def measure(
    workload: str, overrides: list[str], devices, steps: tuple[int, int], reference: bool
) -> dict[str, Any]:
    """Builds the step of `overrides`, measures the peak, times the steps (interleaved with the
    reference loop's when `reference`)."""
    cfg = compose(overrides)
    progress(f"{workload}: compiling ({len(devices)} {devices[0].platform} device(s))")
    mesh_step = MeshtrainStep(cfg, devices)
    setup = mesh_step.setup
    ref_step = ReferenceStep(cfg, devices[0], setup.global_batch) if reference else None
    progress(f"{workload}: measuring the {cfg.training.mixed_precision} matmul peak")
    peak = measured_peak(devices, cfg.training.mixed_precision)
    warmup, timed = steps
    for _ in range(warmup):
        mesh_step()
        if ref_step:
            ref_step()
    progress(
        f"{workload}: timing {timed} steps"
        + (" (interleaved with the reference)" if ref_step else "")
    )
    mesh_times, ref_times = [], []
    for _ in range(timed):
        mesh_times.append(_timed(mesh_step))
        if ref_step:
            ref_times.append(_timed(ref_step))
    tokens_per_step = setup.global_batch * cfg.data.seq_len
    memory, memory_source = peak_memory(devices)
    result = {
        "workload": workload,
        "model": cfg.model.name,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "mesh": {k: int(v) for k, v in setup.mesh.shape.items()},
        "global_batch": setup.global_batch,
        "micro_batch_size": setup.micro_batch_size,
        "seq_len": cfg.data.seq_len,
        "mixed_precision": cfg.training.mixed_precision,
        "flops_per_step": setup.flops_per_step,
        **summarise(mesh_times, tokens_per_step, setup.flops_per_step, len(devices), peak),
        "compile_s": mesh_step.compile_s,
        "peak_memory_gib": memory,
        "peak_memory_source": memory_source,
        "planned_step_memory_gib": mesh_step.planned_memory_gib(),
        "overrides": overrides,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    if ref_step:
        ref = summarise(ref_times, tokens_per_step, setup.flops_per_step, 1, peak)
        result["reference"] = {
            "step_time_s": ref["step_time_s"],
            "tokens_per_sec": ref["tokens_per_sec"],
            "tflops_per_device": ref["tflops_per_device"],
            "mfu": ref["mfu"],
            "compile_s": ref_step.compile_s,
        }
        result["reference_ratio"] = result["tokens_per_sec"] / ref["tokens_per_sec"]
    return result


def fits(cfg, devices) -> bool:
    """Whether the compiled step of `cfg` fits the device's memory (XLA's plan)."""
    import jax

    from meshtrain.train.optimizer import build_optimizer
    from meshtrain.train.setup import compile_train_step, prepare
    from meshtrain.train.state import state_shardings

    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    setup = prepare(cfg, devices)
    tx = build_optimizer(cfg.training)
    shardings = state_shardings(setup.model, tx, setup.mesh)
    try:
        with jax.set_mesh(setup.mesh):
            compiled, _ = compile_train_step(setup, tx, shardings)
    except Exception as err:  # XLA reports a step that cannot fit as a compile error
        progress(f"  does not compile: {str(err).splitlines()[0][:200]}")
        return False
    a = compiled.memory_analysis()
    need = a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes
    need += a.temp_size_in_bytes
    progress(f"  needs {need / 2**30:.1f} GiB of {(limit or 0) / 2**30:.1f} GiB")
    return limit is None or need <= limit


def run_w4(args: argparse.Namespace, devices) -> list[dict[str, Any]]:
    results = []
    warmup, timed = steps_of("W4", args)
    for name in args.model or W4_MODELS:
        base = [
            f"model={name}",
            "data=synthetic",
            f"data.seq_len={W4_SEQ_LEN}",
            "training.mixed_precision=bf16",
            'model.mesh_shape=[[1,1],["fsdp","tp"]]',
            *args.override,
        ]
        candidates = [args.micro_batch] if args.micro_batch else W4_MICRO_BATCHES
        best = None
        for micro in candidates:
            overrides = [*base, f"training.micro_batch_size={micro}"]
            progress(f"W4 {name}: micro-batch {micro}")
            if not args.micro_batch and not fits(compose(overrides), devices):
                break
            try:
                result = measure("W4", overrides, devices[:1], (warmup, timed), reference=False)
            except Exception as err:  # out of memory at run time
                progress(f"  failed: {str(err).splitlines()[0][:200]}")
                break
            spec = f", {result['mfu_spec']:.1%} of the data sheet" if "mfu_spec" in result else ""
            progress(f"  {result['tokens_per_sec']:,.0f} tokens/s, MFU {result['mfu']:.1%}{spec}")
            if best is None or result["tokens_per_sec"] > best["tokens_per_sec"]:
                best = result
        if best is not None:
            results.append(best)
    return results


def steps_of(workload: str, args: argparse.Namespace) -> tuple[int, int]:
    """(warm-up steps, timed steps): --warmup and --steps, else the workload's (--quick) defaults."""
    warmup, timed = (QUICK_STEPS if args.quick else STEPS)[workload]
    return (warmup if args.warmup is None else args.warmup), (args.steps or timed)


def child_main(args: argparse.Namespace) -> None:
    """In the child: measure one workload, write its results (a list) to --child-out."""
    import logging

    from meshtrain.cli.train import configure_xla_gpu_flags

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # As `python run_training.py` does before JAX starts: on GPU, meshtrain's XLA flags.
    configure_xla_gpu_flags("training.xla_gpu_flags=false" not in args.override)
    import jax

    workload = args.child
    devices = jax.devices()
    if workload == "W4":
        if devices[0].platform != "gpu":
            results = [
                {"workload": "W4", "skipped": f"W4 needs a GPU; found {devices[0].platform}"}
            ]
        else:
            results = run_w4(args, devices)
    else:
        if len(devices) < DEVICES[workload]:
            raise SystemExit(f"{workload} needs {DEVICES[workload]} devices, found {len(devices)}")
        warmup, timed = steps_of(workload, args)
        overrides = [*OVERRIDES[workload], *args.override]
        reference = args.reference and workload == "W1"
        results = [
            measure(workload, overrides, devices[: DEVICES[workload]], (warmup, timed), reference)
        ]
    Path(args.child_out).write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------------
# W3: the default command, from launch to the end of step 1.

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


# ---------------------------------------------------------------------------------------------
# Output.


def describe(result: dict[str, Any]) -> list[str]:
    w = result["workload"]
    if "skipped" in result:
        return [f"{w}: {result['skipped']}"]
    if w == "W3":
        lines = [
            f"W3 `{result['launched']}`, launch to the end of step 1:",
            f"  cold {result['cold_s']:.1f} s (empty caches; milestones {result['cold_milestones_s']})",
            f"  warm {result['warm_s']:.1f} s (second launch; milestones {result['warm_milestones_s']})",
        ]
        return lines
    lines = [
        f"{w} {result['model']}: {result['devices']} {result['device_kind']} device(s), mesh "
        f"{result['mesh']}, batch {result['global_batch']} × {result['seq_len']}, "
        f"{result['mixed_precision']}",
        f"  step time    {result['step_time_s']:.4f} s (median of {result['steps_timed']}; "
        f"min {result['step_time_min_s']:.4f}, max {result['step_time_max_s']:.4f})",
        f"  tokens/s     {result['tokens_per_sec']:,.0f}",
        f"  TFLOP/s/dev  {result['tflops_per_device']:.4g}",
        f"  MFU          {result['mfu']:.1%} of {result['peak_tflops'] * 1e3:.1f} GFLOP/s per "
        f"device ({result['peak_source']}); {result['mfu_best_known_peak']:.1%} of the best "
        f"known here, {result['best_known_peak_tflops'] * 1e3:.1f} GFLOP/s",
    ]
    if "mfu_spec" in result:
        lines.append(
            f"  MFU (spec)   {result['mfu_spec']:.1%} of {result['spec_peak_tflops']:.0f} TFLOP/s"
        )
    lines += [
        f"  compile      {result['compile_s']:.1f} s",
        f"  peak memory  {result['peak_memory_gib']:.2f} GiB ({result['peak_memory_source']}); "
        f"the compiled step plans {result['planned_step_memory_gib']:.3f} GiB",
    ]
    if "reference" in result:
        ref = result["reference"]
        lines.append(
            f"  reference    {ref['tokens_per_sec']:,.0f} tokens/s ({ref['step_time_s']:.4f} s/step, "
            f"MFU {ref['mfu']:.1%}); meshtrain / reference = {result['reference_ratio']:.2f}×"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", action="append", choices=WORKLOADS, help="default: W1")
    parser.add_argument("--json", action="store_true", help="one JSON object per workload")
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke test)")
    parser.add_argument("--reference", action="store_true", help="W1: also the hand-written loop")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (W1, W2, W4)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument("--micro-batch", type=int, default=None, help="W4: skip the search")
    parser.add_argument(
        "--model", action="append", default=[], choices=W4_MODELS, help="W4: default both"
    )
    parser.add_argument(
        "--override", action="append", default=[], help="extra Hydra override of every workload"
    )
    parser.add_argument("--save", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args)
        return
    results = []
    for workload in dict.fromkeys(args.workload or ["W1"]):
        found = [run_w3(args.override)] if workload == "W3" else run_child(workload, args)
        for result in found:
            result = stamp(result, argv)
            results.append(result)
            if args.json:
                print(json.dumps(result), flush=True)
            else:
                print("\n".join(describe(result)), flush=True)
    if args.save:
        document = {"results": results}
        args.save.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
