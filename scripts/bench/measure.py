"""W1 and W2 (and each W4 candidate): meshtrain's step built as a run builds it, the measured
matmul peak, the timed steps and their summary."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from bench.common import (
    _timed,
    compose,
    peak_memory,
    progress,
)
from bench.reference import ReferenceStep


class MeshtrainStep:
    """meshtrain's step for a config, built as `python run_training.py` builds it."""

    def __init__(self, cfg, devices) -> None:
        import jax

        from meshtrain.data import BatchIterator
        from meshtrain.train.batch import process_rows, to_global_array
        from meshtrain.train.compilation import compile_train_step
        from meshtrain.train.optimizer import build_optimizer
        from meshtrain.train.setup import prepare
        from meshtrain.train.state import create_train_state, state_shardings
        from meshtrain.weights.lora_base import load_frozen_base

        self.setup = setup = prepare(cfg, devices)
        tx = build_optimizer(cfg.training)
        shardings = state_shardings(setup.model, tx, setup.mesh)
        with jax.set_mesh(setup.mesh):
            start = time.perf_counter()
            self.compiled, batch_sharding = compile_train_step(setup, tx, shardings)
            self.compile_s = time.perf_counter() - start
            # LoRA: the frozen base (the seed's random one: no weights are read), then adapters.
            frozen = load_frozen_base(cfg, setup.model) if setup.model.lora else None
            seed = cfg.training.seed
            self.state = create_train_state(cfg.model, tx, shardings, seed, frozen=frozen)
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


def measured_peak(devices, compute_dtype: str) -> dict[str, Any]:
    """This run's matmul peak per device (measured now; the cache keeps the best), and the
    published one where meshtrain knows the device."""
    import jax

    from meshtrain.hardware.accelerators import accelerator_for_kind
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
