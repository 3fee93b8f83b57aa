"""The training run, in the order of the diagram in docs/architecture.md: set-up → checkpoints →
compiled step → data → state (resumed or fresh) → the loop, where each step is followed by its
hooks: log, evaluate, save. This is the one module that wires the sinks and hooks together.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding

from meshtrain.checkpoint import RunCheckpoints
from meshtrain.config.schema import Config
from meshtrain.data import BatchIterator
from meshtrain.distributed.preemption import StopSignals
from meshtrain.inference.initial_weights import check_initial_weights, load_initial_params
from meshtrain.inference.lora_base import initial_adapters, load_frozen_base
from meshtrain.observe.communication import CommunicationReport
from meshtrain.observe.metrics import MetricsWriter, setup_logging
from meshtrain.observe.profiler import ProfilerWindow
from meshtrain.observe.progress import phase
from meshtrain.observe.throughput import ThroughputMeter
from meshtrain.train.batch import DeviceBatches, process_rows
from meshtrain.train.evaluation import make_evaluator
from meshtrain.train.guard import raise_if_nonfinite
from meshtrain.train.harness_hook import harness_hook
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.pipeline_plan import measure_bubble
from meshtrain.train.resume import check_resume, run_meta
from meshtrain.train.setup import (
    Setup,
    compile_train_step,
    describe,
    inspect_compiled,
    prepare,
    throughput_meter,
)
from meshtrain.train.state import (
    TrainState,
    abstract_train_state,
    create_train_state,
    join_state,
    split_state,
    state_shardings,
)

log = logging.getLogger(__name__)

# The step's metrics in the order they are logged (nonfinite_skips only with nonfinite=skip).
_METRICS = ("loss", "learning_rate", "grad_norm", "nonfinite_skips")


@dataclass
class RunResult:
    """What a finished run hands back to callers and tests."""

    history: list[dict[str, float]]  # one entry per logged step
    state: TrainState
    setup: Setup
    stopped_by: int | None = None  # the signal that stopped the run early, after it saved


def train(cfg: Config, run_dir: Path, *, devices: Sequence[jax.Device] | None = None) -> RunResult:
    """Runs a whole training job and writes its logs and metrics into `run_dir`."""
    is_main = jax.process_index() == 0
    if jax.process_count() == 1:  # (several processes: joining the run set up the log files)
        setup_logging(None, is_main=True)  # the console, until the run directory is written
    setup = prepare(cfg, devices)
    cfg = setup.cfg  # with the defaults that depend on the mesh decided (model.scan_layers)
    training = cfg.training
    tx = build_optimizer(training)
    shardings = state_shardings(setup.model, tx, setup.mesh)
    checkpoints = _open_checkpoints(setup, tx, shardings, run_dir)
    try:  # until the `with` below, a failure must not keep the run's directory locked
        if is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(run_dir, is_main=is_main, rank=jax.process_index())
        describe(setup)
    except BaseException:
        checkpoints.close()
        raise

    signals = StopSignals(agree_every=training.log_every)
    with (
        jax.set_mesh(setup.mesh),
        signals,
        checkpoints,
    ):  # the last write commits before handlers go
        train_step, batch_sharding = compile_train_step(setup, tx, shardings)
        _, communication = inspect_compiled(setup, train_step, tx, shardings, run_dir, is_main)
        batches = _batch_iterator(setup, batch_sharding)
        state, start_step = _initial_state(setup, checkpoints, tx, shardings, batches)
        evaluate = make_evaluator(setup, shardings)
        harness = harness_hook(cfg, setup.model)
        meter = throughput_meter(setup)

        history: list[dict[str, float]] = []
        stopped_by: int | None = None
        clock = _Interval(start_step)
        with (
            MetricsWriter(
                run_dir,
                total_steps=training.steps,
                is_main=is_main,
                start_step=start_step,
                tokens_per_step=setup.global_batch * cfg.data.seq_len,
                config=cfg,  # its logging.trackers, and the config each of them logs
            ) as writer,
            ProfilerWindow(
                cfg.profile,
                run_dir,
                enabled=training.profile,
                last_step=training.steps,
                on_trace=_report_measured(setup, communication, run_dir, is_main),
            ) as profiler,
        ):
            clock.restart(start_step)  # opening the trackers is not step time
            for step in range(start_step + 1, training.steps + 1):
                batch = next(batches)  # read and sent while the previous step ran
                profiler.before_step(step, state)
                state, metrics = train_step(state, batch)
                writer.dispatched(step, metrics["loss"])
                is_last = step == training.steps
                if not is_last:
                    with meter.data_wait():
                        batches.prefetch()  # the next batch, while the devices run this step
                profiler.after_step(step, state)

                stop = signals.stop_requested(step)
                eval_now = evaluate is not None and (is_last or step % training.eval_every == 0)
                harness_now = harness is not None and harness.due(step, is_last)
                log_now = step == start_step + 1 or step % training.log_every == 0 or is_last
                if log_now or eval_now or harness_now or stop:
                    values = _step_metrics(metrics, clock, meter, step, setup)
                    values.update(_data_shares(batches, step))
                    if eval_now:
                        values["val_loss"] = evaluate(state)
                        values["val_perplexity"] = math.exp(min(values["val_loss"], 80.0))
                        clock.restart(step)  # evaluation time is not step time
                    if harness_now:
                        values.update(harness(state))
                        clock.restart(step)
                    history.append({"step": step, **values})
                    writer.write(step, values)
                    _stop_if_nonfinite(state, cfg, checkpoints)
                saved = _save_checkpoint(
                    checkpoints, step, state, batches, cfg, force=is_last or stop
                )
                if saved:  # the save waited for the step; its own time is not step time
                    clock.restart(step)
                if saved and not (stop or is_last):
                    # A signal that came during this save: stop on the checkpoint just saved,
                    # rather than train and save one more step (every process saved here).
                    stop = signals.stop_requested(step, agree_now=True)
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


def _open_checkpoints(
    setup: Setup, tx: optax.GradientTransformation, shardings: TrainState, run_dir: Path
) -> RunCheckpoints:
    """This run's checkpoints and, for a fresh run, its initial weights, checked against the
    disk before anything compiles or is written."""
    cfg = setup.cfg
    params, rest = split_state(abstract_train_state(setup.model, tx, shardings))
    meta = run_meta(cfg)
    checkpoints = RunCheckpoints.open(
        cfg.checkpoint,
        run_dir,
        params,
        rest,
        steps=cfg.training.steps,
        run_meta=meta,
        check_meta=lambda saved, path: check_resume(saved, path, meta, setup.global_batch),
    )
    try:
        check_initial_weights(cfg, setup.model, resuming=checkpoints.resuming)
    except BaseException:
        checkpoints.close()  # releases the lock of its directory
        raise
    return checkpoints


def _batch_iterator(setup: Setup, batch_sharding: NamedSharding) -> DeviceBatches:
    """The train batches, as device arrays one step ahead: this process reads only its rows of
    each global batch."""
    rows = process_rows(batch_sharding, setup.batch_shape, axis=1)
    log.info("this process reads rows %d:%d of each micro-batch", rows.start, rows.stop)
    host_batches = BatchIterator(
        setup.train_data,
        global_batch=setup.global_batch,
        accum_steps=setup.cfg.training.gradient_accumulation_steps,
        rows=rows,
        seed=setup.cfg.training.seed,
        workers=setup.cfg.data.workers,
    )
    return DeviceBatches(host_batches, batch_sharding, setup.batch_shape)


def _initial_state(
    setup: Setup,
    checkpoints: RunCheckpoints,
    tx: optax.GradientTransformation,
    shardings: TrainState,
    batches: DeviceBatches,
) -> tuple[TrainState, int]:
    """The resumed state and its step (the data moved there), or a fresh state at step 0."""
    cfg, model, run_checkpoints = setup.cfg, setup.model, checkpoints.directory
    frozen = None
    if model.lora:  # read at every start: the checkpoints hold only the adapters
        with phase(log, "reading the frozen LoRA base", "read the frozen LoRA base"):
            frozen = load_frozen_base(cfg, model, checkpoint_dir_of_run=run_checkpoints)

    def fresh() -> tuple[Any, TrainState]:
        if model.lora:
            params = initial_adapters(cfg, model)
        else:
            params = load_initial_params(cfg, model, checkpoint_dir_of_run=run_checkpoints)
        state = create_train_state(cfg.model, tx, shardings, cfg.training.seed, params, frozen)
        return split_state(state)

    with phase(log, "preparing the train state", "prepared the train state"):
        params, rest, start_step = checkpoints.restore_or_init(fresh, batches)
    return join_state(params, rest, frozen), start_step


class _Interval:
    """Wall time of the steps since the last measurement: fetching a step's metrics waits for
    it, so the interval up to a fetch is real device time. The step was compiled before the
    loop; the first step includes only warm-up effects."""

    def __init__(self, step: int) -> None:
        self.restart(step)

    def restart(self, step: int) -> None:
        self.start, self.step = time.perf_counter(), step

    def per_step(self, step: int) -> float:
        now = time.perf_counter()
        seconds = (now - self.start) / (step - self.step)
        self.start, self.step = now, step
        return seconds


def _step_metrics(
    metrics: dict[str, jax.Array],
    clock: _Interval,
    meter: ThroughputMeter,
    step: int,
    setup: Setup,
) -> dict[str, float]:
    """The logged values of a step: its metrics (one host transfer) and the throughput."""
    fetched = jax.device_get(metrics)
    values = {k: float(fetched[k]) for k in _METRICS if k in fetched}
    values["step_time_s"] = clock.per_step(step)
    tokens_per_step = setup.global_batch * setup.cfg.data.seq_len
    values["tokens_per_sec"] = tokens_per_step / values["step_time_s"]
    values.update(meter.metrics(values["step_time_s"]))
    return values


def _data_shares(batches: DeviceBatches, step: int) -> dict[str, float]:
    """data_share/<source>: each mixture source's share of the sequences of steps 1..step, as
    drawn (the steps before a resume included)."""
    return {f"data_share/{name}": share for name, share in batches.shares(step).items()}


def _stop_if_nonfinite(state: TrainState, cfg: Config, checkpoints: RunCheckpoints) -> None:
    last = checkpoints.last_saved
    raise_if_nonfinite(state.nonfinite, cfg.training.nonfinite, last_saved=last)


def _save_checkpoint(
    checkpoints: RunCheckpoints,
    step: int,
    state: TrainState,
    batches: DeviceBatches,
    cfg: Config,
    *,
    force: bool,
) -> bool:
    """Saves when due (checkpoint.every_steps, the last step, a stop signal); never a state
    that has met a NaN or Inf with training.nonfinite=stop. Returns whether a save started."""
    if not checkpoints.is_due(step, force=force):
        return False
    _stop_if_nonfinite(state, cfg, checkpoints)
    params, rest = split_state(state)
    checkpoints.save(step, params, rest, batches)
    return True


def _report_measured(
    setup: Setup, communication: CommunicationReport, run_dir: Path, is_main: bool
) -> Callable[[Path, int], None]:
    """The profiler's hook: the collectives' measured share of the traced steps, and the
    pipeline's measured bubble."""

    def on_trace(trace: Path, num_steps: int) -> None:
        lines = communication.measure(trace, num_steps)
        if setup.pipeline is not None:
            lines += measure_bubble(setup.pipeline, communication, setup.mesh, trace, num_steps)
        for line in lines:
            log.info(line)
        if setup.cfg.training.profile_communication and is_main:
            communication.write(run_dir / "communication.json")

    return on_trace
