"""The training run: validate → mesh → sharded state → data → loop, wiring the metric sinks.

This is the only module that knows about every other one; it reads top to bottom in the order
a run goes.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from meshtrain.checkpoint import RunCheckpoints
from meshtrain.communication import CommunicationReport, account_collectives
from meshtrain.config import Config
from meshtrain.data import BatchIterator, TokenDataset, build_dataset, validation_batches
from meshtrain.distributed import process_hosts
from meshtrain.errors import ConfigError
from meshtrain.flops import format_flops, train_flops_per_step
from meshtrain.mesh import MeshSpec, build_mesh, format_mesh_shape, parse_mesh_shape
from meshtrain.metrics import MetricsWriter, setup_logging
from meshtrain.plan import MemoryPlan, device_capacity, memory_plan
from meshtrain.preemption import StopSignals
from meshtrain.profiler import ProfilerWindow
from meshtrain.sharding import logical_to_spec
from meshtrain.throughput import ThroughputMeter, peak_flops_per_device
from meshtrain.train.batch import process_rows, to_global_array
from meshtrain.train.guard import raise_if_nonfinite
from meshtrain.train.optimizer import build_optimizer, learning_rate_schedule
from meshtrain.train.state import (
    ModelPlan,
    TrainState,
    abstract_train_state,
    create_train_state,
    plan_model,
    state_shardings,
)
from meshtrain.train.step import make_eval_step, make_train_step
from meshtrain.validate import check_against_mesh, check_config, micro_batch_size

log = logging.getLogger(__name__)

# The step's metrics in the order they are logged (nonfinite_skips only with nonfinite=skip).
_METRICS = ("loss", "learning_rate", "grad_norm", "nonfinite_skips")


@dataclass
class Setup:
    """Everything decided at start-up, before any compile or allocation."""

    cfg: Config
    mesh_spec: MeshSpec
    mesh: Mesh
    plan: ModelPlan
    micro_batch_size: int
    train_data: TokenDataset | None  # None in a dry run, which reads no data
    validation_data: TokenDataset | None

    @property
    def batch_shards(self) -> int:
        return self.mesh.shape["dp"] * self.mesh.shape["fsdp"]

    @property
    def micro_global(self) -> int:
        """Sequences per micro-batch over the whole mesh."""
        return self.micro_batch_size * self.batch_shards

    @property
    def global_batch(self) -> int:
        return self.micro_global * self.cfg.training.gradient_accumulation_steps

    @property
    def batch_shape(self) -> tuple[int, int, int]:
        """The train step's batch: [accumulation steps, micro_global, seq_len + 1]."""
        accum = self.cfg.training.gradient_accumulation_steps
        return (accum, self.micro_global, self.cfg.data.seq_len + 1)

    @property
    def flops_per_step(self) -> int:
        """Model FLOPs of one update, all devices (meshtrain.flops)."""
        return train_flops_per_step(
            self.cfg.model, seq_len=self.cfg.data.seq_len, sequences=self.global_batch
        )


@dataclass
class RunResult:
    """What a finished run hands back to callers and tests."""

    history: list[dict[str, float]]  # one entry per logged step
    state: TrainState
    setup: Setup
    stopped_by: int | None = None  # the signal that stopped the run early, after it saved


def _build_data(cfg: Config, split: str) -> TokenDataset:
    try:
        return build_dataset(cfg.data, split=split, vocab_size=cfg.model.vocab_size)
    except ValueError as err:  # the data modules name the key and the fix
        raise ConfigError(str(err)) from None


def prepare(
    cfg: Config, devices: Sequence[jax.Device] | None = None, *, with_data: bool = True
) -> Setup:
    """All start-up checks; raises ConfigError before anything is compiled or allocated."""
    check_config(cfg)
    devices = list(devices) if devices is not None else jax.devices()
    mesh_spec = parse_mesh_shape(cfg.model.mesh_shape, len(devices))
    check_against_mesh(cfg, mesh_spec)
    mesh = build_mesh(mesh_spec, devices, hosts=process_hosts())
    plan = plan_model(cfg.model, mesh, mesh_spec)  # shapes only: eval_shape allocates nothing
    if not with_data:
        return Setup(cfg, mesh_spec, mesh, plan, micro_batch_size(cfg, mesh_spec), None, None)
    train_data = _build_data(cfg, "train")
    if len(train_data) == 0:
        raise ConfigError(
            f"data.path={cfg.data.path!r} with data.glob={cfg.data.glob!r} gave no training sequences"
        )
    validation_data = _build_data(cfg, "validation") if cfg.training.eval_every else None
    if validation_data is not None and len(validation_data) == 0:
        validation_data = None
    return Setup(
        cfg, mesh_spec, mesh, plan, micro_batch_size(cfg, mesh_spec), train_data, validation_data
    )


def _describe(setup: Setup) -> None:
    cfg = setup.cfg
    num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(setup.plan.abstract_params))
    sizes = [setup.mesh_spec.sizes[a] for a in setup.mesh.axis_names]
    log.info(
        "mesh %s on %d %s device(s), %d process(es)",
        format_mesh_shape(sizes, setup.mesh.axis_names),
        setup.mesh.size,
        setup.mesh.devices.flat[0].platform,
        jax.process_count(),
    )
    log.info("model %s: %s parameters", cfg.model.name, f"{num_params:,}")
    log.info(
        "global batch %d sequences × %d tokens (micro_batch_size %d × %d batch shards × %d accumulation steps)",
        setup.global_batch,
        cfg.data.seq_len,
        setup.micro_batch_size,
        setup.batch_shards,
        cfg.training.gradient_accumulation_steps,
    )
    if setup.train_data is not None:
        log.info("data: %d training sequences (%s)", len(setup.train_data), cfg.data.source)


def _evaluate(eval_step, params: Any, batches: list[jax.Array]) -> float:
    sums = [eval_step(params, batch) for batch in batches]
    loss_sum, count = np.sum(np.asarray(jax.device_get(sums), dtype=np.float64), axis=0)
    return float(loss_sum / max(count, 1.0))


def train(cfg: Config, run_dir: Path, *, devices: Sequence[jax.Device] | None = None) -> RunResult:
    """Runs a whole training job and writes its logs and metrics into `run_dir`."""
    setup = prepare(cfg, devices)
    checkpoints = RunCheckpoints.open(cfg, run_dir, setup.plan)
    is_main = jax.process_index() == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir, is_main=is_main, rank=jax.process_index())
    _describe(setup)
    training = cfg.training
    mesh = setup.mesh

    signals = StopSignals(agree_every=training.log_every)
    with jax.set_mesh(mesh), signals, checkpoints:  # the last write commits before handlers go
        tx = build_optimizer(training)
        shardings = state_shardings(setup.plan, tx, mesh)

        batch_shape = setup.batch_shape
        train_step, batch_sharding = compile_train_step(
            setup, tx, shardings, pad_id=setup.train_data.pad_id
        )
        _, communication = _inspect(setup, train_step, tx, shardings, run_dir, is_main)
        rows = process_rows(batch_sharding, batch_shape, axis=1)
        log.info("this process reads rows %d:%d of each micro-batch", rows.start, rows.stop)
        batches = BatchIterator(
            setup.train_data,
            global_batch=setup.global_batch,
            accum_steps=training.gradient_accumulation_steps,
            rows=rows,
            seed=training.seed,
        )
        # A resumed state comes with the data position; `init` creates a fresh one (around
        # loaded parameters when fine-tuning).
        state, start_step = checkpoints.restore_or_init(
            abstract_train_state(setup.plan, tx, shardings),
            lambda params: create_train_state(
                cfg.model, setup.plan, tx, shardings, training.seed, params
            ),
            batches,
        )
        evaluate = _make_evaluator(setup, shardings)
        meter = _throughput_meter(setup)

        def on_trace(trace: Path, num_steps: int) -> None:
            for line in communication.measure(trace, num_steps):
                log.info(line)
            if training.profile_communication and is_main:
                communication.write(run_dir / "communication.json")

        history: list[dict[str, float]] = []
        stopped_by: int | None = None
        tokens_per_step = setup.global_batch * cfg.data.seq_len
        with (
            MetricsWriter(
                run_dir, total_steps=training.steps, is_main=is_main, start_step=start_step
            ) as writer,
            ProfilerWindow(
                cfg.profile,
                run_dir,
                enabled=training.profile,
                last_step=training.steps,
                on_trace=on_trace,
            ) as profiler,
        ):
            interval_start, interval_step = time.perf_counter(), start_step
            for step in range(start_step + 1, training.steps + 1):
                with meter.data_wait():
                    batch = to_global_array(next(batches), batch_sharding, batch_shape)
                profiler.before_step(step, state)
                state, metrics = train_step(state, batch)
                profiler.after_step(step, state)
                is_last = step == training.steps
                stop = signals.stop_requested(step)
                eval_now = evaluate is not None and (is_last or step % training.eval_every == 0)
                log_now = step == start_step + 1 or step % training.log_every == 0 or is_last
                if log_now or eval_now or stop:
                    fetched = jax.device_get(metrics)
                    values = {k: float(fetched[k]) for k in _METRICS if k in fetched}
                    # Fetching the metrics waited for the step, so this interval is real device
                    # time. The step was compiled before the loop; the first step includes only
                    # warm-up effects.
                    now = time.perf_counter()
                    values["step_time_s"] = (now - interval_start) / (step - interval_step)
                    values["tokens_per_sec"] = tokens_per_step / values["step_time_s"]
                    values.update(meter.metrics(values["step_time_s"]))
                    interval_start, interval_step = now, step
                    if eval_now:
                        values["val_loss"] = evaluate(state.params)
                        interval_start = time.perf_counter()  # evaluation time is not step time
                    history.append({"step": step, **values})
                    writer.write(step, values)
                    last = checkpoints.last_saved
                    raise_if_nonfinite(state.nonfinite, training.nonfinite, last_saved=last)
                if checkpoints.maybe_save(step, state, batches, force=is_last or stop):
                    # The save waited for the step; its own time is not step time.
                    interval_start, interval_step = time.perf_counter(), step
                if stop:
                    stopped_by = signals.received
                    break
    if stopped_by is not None:
        log.warning(
            "stopped by %s; checkpoint %s is complete; run the same command to resume",
            signal.Signals(stopped_by).name,
            checkpoints.last_saved,
        )
        return RunResult(history=history, state=state, setup=setup, stopped_by=stopped_by)
    log.info("finished %d steps in %s", training.steps, run_dir)
    return RunResult(history=history, state=state, setup=setup)


def dry_run(
    cfg: Config, run_dir: Path, *, devices: Sequence[jax.Device] | None = None
) -> MemoryPlan:
    """Compiles the train step on abstract inputs, allocating no weights, then logs the memory
    plan and writes plan.json (and communication.json with training.profile_communication)."""
    setup = prepare(cfg, devices, with_data=False)
    is_main = jax.process_index() == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir, is_main=is_main, rank=jax.process_index())
    _describe(setup)
    with jax.set_mesh(setup.mesh):
        tx = build_optimizer(cfg.training)
        shardings = state_shardings(setup.plan, tx, setup.mesh)
        # No data is read: nothing is padded, which changes neither memory nor communication.
        compiled, _ = compile_train_step(setup, tx, shardings, pad_id=-1)
        plan, _ = _inspect(setup, compiled, tx, shardings, run_dir, is_main)
    log.info("dry run: plan written to %s", run_dir / "plan.json")
    return plan


def compile_train_step(
    setup: Setup, tx: optax.GradientTransformation, shardings: TrainState, *, pad_id: int
) -> tuple[jax.stages.Compiled, NamedSharding]:
    """The train step compiled from shapes and shardings alone, and the batch's sharding.

    Compiling ahead of the loop gives the plan and the communication report the executable that
    will run, and keeps compilation out of the first step's time.
    """
    cfg = setup.cfg
    batch_sharding = NamedSharding(
        setup.mesh, logical_to_spec((None, "batch", None), cfg.model.logical_axis_rules)
    )
    train_step = make_train_step(
        setup.plan,
        tx,
        learning_rate_schedule(cfg.training),
        state_shardings=shardings,
        batch_sharding=batch_sharding,
        pad_id=pad_id,
        mixed_precision=cfg.training.mixed_precision,
        nonfinite=cfg.training.nonfinite,
    )
    abstract_batch = jax.ShapeDtypeStruct(setup.batch_shape, np.int32, sharding=batch_sharding)
    start = time.perf_counter()
    compiled = train_step.lower(
        abstract_train_state(setup.plan, tx, shardings), abstract_batch
    ).compile()
    log.info("compiled the train step in %.1f s", time.perf_counter() - start)
    return compiled, batch_sharding


def _inspect(
    setup: Setup,
    compiled: jax.stages.Compiled,
    tx: optax.GradientTransformation,
    shardings: TrainState,
    run_dir: Path,
    is_main: bool,
) -> tuple[MemoryPlan, CommunicationReport]:
    """Logs the compiled step's memory plan (and every collective, with
    training.profile_communication) and writes plan.json (and communication.json)."""
    cfg = setup.cfg
    communication = account_collectives(compiled.as_text(), setup.mesh)
    device, capacity = device_capacity(
        cfg.plan.device, list(setup.mesh.devices.flat), cfg.plan.memory_fraction
    )
    plan = memory_plan(
        compiled,
        mesh=setup.mesh,
        micro_batch_size=setup.micro_batch_size,
        abstract_state=abstract_train_state(setup.plan, tx, shardings),
        state_shardings=shardings,
        collective_bytes_per_step=communication.ring_bytes_per_step,
        flops_per_step=setup.flops_per_step / setup.mesh.size,
        device=device,
        capacity_bytes=capacity,
        remat=cfg.model.remat,
        scan_layers=cfg.model.scan_layers,
    )
    lines = plan.format()
    if cfg.training.profile_communication:
        lines += communication.format()
    for line in lines:
        log.info(line)
    if is_main:
        plan.write(run_dir / "plan.json")
        if cfg.training.profile_communication:
            communication.write(run_dir / "communication.json")
    return plan, communication


def _throughput_meter(setup: Setup) -> ThroughputMeter:
    devices = list(setup.mesh.devices.flat)
    peak, source = peak_flops_per_device(devices, setup.cfg.training.mixed_precision)
    if peak is None:
        log.info("MFU: %s", source)
    else:
        log.info("MFU against %s per device (%s)", format_flops(peak, "/s"), source)
    return ThroughputMeter(
        devices=devices,
        tokens_per_step=setup.global_batch * setup.cfg.data.seq_len,
        flops_per_step=setup.flops_per_step,
        peak_flops_per_device=peak,
    )


def _make_evaluator(setup: Setup, shardings: TrainState):
    """A function params → mean validation loss over fixed batches, or None when eval is off."""
    cfg = setup.cfg
    if setup.validation_data is None:
        return None
    eval_shape = (setup.micro_global, cfg.data.seq_len + 1)
    eval_sharding = NamedSharding(
        setup.mesh, logical_to_spec(("batch", None), cfg.model.logical_axis_rules)
    )
    local = validation_batches(
        setup.validation_data,
        global_batch=setup.micro_global,
        num_batches=cfg.training.eval_batches,
        rows=process_rows(eval_sharding, eval_shape, axis=0),
    )
    device_batches = [to_global_array(b, eval_sharding, eval_shape) for b in local]
    eval_step = make_eval_step(
        setup.plan,
        param_shardings=shardings.params,
        batch_sharding=eval_sharding,
        pad_id=setup.validation_data.pad_id,
        mixed_precision=cfg.training.mixed_precision,
    )
    return lambda params: _evaluate(eval_step, params, device_batches)


def with_overrides(cfg: Config, **sections: dict[str, Any]) -> Config:
    """A copy of cfg with some fields replaced, e.g. with_overrides(cfg, training={"steps": 5})."""
    return replace(
        cfg, **{name: replace(getattr(cfg, name), **fields) for name, fields in sections.items()}
    )
