"""The training run, in the order of the diagram in docs/architecture.md: set-up → checkpoints →
compiled step → data → state (resumed or fresh) → the loop: for each step, its batch, the step,
then the hooks that are due (train.hooks: metrics, non-finite guard, checkpoint, validation loss,
lm-eval harness, profiler). This is the one module that wires the sinks and hooks together.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding

from meshtrain.checkpoint import RunCheckpoints
from meshtrain.config.objective import precomputed_reference
from meshtrain.config.run_record import keep_run_record
from meshtrain.config.schema import Config
from meshtrain.data import BatchIterator, MixedDataset
from meshtrain.distributed.preemption import StopSignals
from meshtrain.observe.metrics import MetricsWriter, setup_logging
from meshtrain.observe.progress import phase
from meshtrain.observe.throughput import ThroughputMeter
from meshtrain.rl.rollouts import RolloutBatches
from meshtrain.rl.sampling import Sampler, ValidationRollouts
from meshtrain.train.batch import BatchSource, DeviceBatches, process_rows
from meshtrain.train.compilation import (
    compile_train_step,
    inspect_compiled,
    old_log_probs_program,
    throughput_meter,
)
from meshtrain.train.describe import describe
from meshtrain.train.evaluation import make_evaluator
from meshtrain.train.hooks import AnyOf, Cadence, Hook, HookRunner, StepInfo
from meshtrain.train.hooks.checkpoint import NonfiniteGuard, SaveCheckpoint
from meshtrain.train.hooks.epochs import EpochLog
from meshtrain.train.hooks.harness import harness_tasks
from meshtrain.train.hooks.profiler import Profiler
from meshtrain.train.hooks.step_metrics import StepClock, StepMetrics
from meshtrain.train.hooks.validation import ValidationLoss, ValidationMetrics
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.reference_scores import score_datasets
from meshtrain.train.resume import check_resume, run_meta
from meshtrain.train.setup import Setup, prepare
from meshtrain.train.starting_weights import StartingWeights
from meshtrain.train.state import (
    TrainState,
    abstract_train_state,
    create_train_state,
    join_state,
    split_state,
    state_shardings,
)
from meshtrain.weights.initial_weights import check_initial_weights
from meshtrain.weights.lora_base import initial_adapters

log = logging.getLogger(__name__)


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
    shardings = state_shardings(setup.model, tx, setup.mesh, reference=setup.reference_copy)
    checkpoints = _open_checkpoints(setup, tx, shardings, run_dir)
    keep_run_record(run_dir)  # accepted: its lock is held and its resume compared
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
        weights = StartingWeights(setup, shardings, checkpoints.directory)
        if precomputed_reference(cfg.objective):  # the rows carry the reference's scores
            score_datasets(setup, shardings, weights.reference)
        batches = _batch_iterator(setup, batch_sharding)
        state, start_step = _initial_state(setup, checkpoints, tx, shardings, batches, weights)
        del weights  # what a resumed start read for the scores goes
        batches.follow(state)  # a policy-gradient run samples from the policy it trains
        clock = StepClock(start_step)
        saves = SaveCheckpoint(cfg.checkpoint, checkpoints=checkpoints, batches=batches)
        evaluations = _evaluation_hooks(setup, shardings)
        meter = throughput_meter(setup)
        metrics_hooks = _metrics_hooks(
            setup, evaluations, saves, checkpoints, clock, meter, batches
        )
        profiler = Profiler(setup, run_dir, communication, is_main=is_main)
        history: list[dict[str, float]] = []
        stopped_by: int | None = None
        with (
            MetricsWriter(
                run_dir,
                total_steps=training.steps,
                is_main=is_main,
                start_step=start_step,
                tokens_per_step=setup.global_batch * cfg.data.seq_len,
                config=cfg,  # its logging.trackers, and the config each of them logs
            ) as writer,
            HookRunner(
                # The save runs last, after the step's record (HookRunner: after_record).
                [profiler, *metrics_hooks, *evaluations, saves],
                write=lambda step, record: _write(writer, history, step, record),
                restart_clock=clock.restart,
            ) as hooks,
        ):
            clock.restart(start_step)  # opening the trackers is not step time
            for step in range(start_step + 1, training.steps + 1):
                batch = next(batches)  # read and sent while the previous step ran
                hooks.before_step(step, state)
                state, metrics = train_step(state, batch)
                batches.follow(state)
                writer.dispatched(step, metrics["loss"])
                is_last = step == training.steps
                if not is_last:
                    with meter.data_wait():
                        batches.prefetch()  # the next batch, while the devices run this step
                stop = signals.stop_requested(step)
                hooks.run(StepInfo(step, state, metrics, step == start_step + 1, is_last, stop))
                if saves.saved_step == step and not (stop or is_last):
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


def _batch_iterator(setup: Setup, batch_sharding: NamedSharding) -> BatchSource:
    """The train batches, as device arrays one step ahead: this process reads only its rows of
    each global batch; or a policy-gradient run's sampled completions (data=prompts)."""
    if setup.rollouts is not None:
        rollouts, cfg = setup.rollouts, setup.cfg
        return RolloutBatches(
            _sampler(setup),
            rollouts.prompts,
            seed=cfg.training.seed,
            sharding=batch_sharding,
            global_shape=setup.batch_shape,
            layout=setup.rollout_layout,
            old_log_probs=old_log_probs_program(setup),
        )
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


def _sampler(setup: Setup) -> Sampler:
    """What samples a policy-gradient run's completions and scores them."""
    rollouts = setup.rollouts
    return Sampler(
        setup.model,
        rollouts.rewards,
        rollouts.tokenizer,
        setup.cfg.objective,
        width=rollouts.width,
        mesh=setup.mesh,
    )


def _initial_state(
    setup: Setup,
    checkpoints: RunCheckpoints,
    tx: optax.GradientTransformation,
    shardings: TrainState,
    batches: BatchSource,
    weights: StartingWeights,
) -> tuple[TrainState, int]:
    """The resumed state and its step (the data moved there), or a fresh state at step 0."""
    cfg, model = setup.cfg, setup.model
    frozen = None
    if model.lora:  # read at every start: the checkpoints hold only the adapters
        frozen = weights.base()
    elif setup.reference_copy:  # read at every start: the checkpoints hold the policy only
        frozen = weights.params()

    def fresh() -> tuple[Any, TrainState]:
        params = initial_adapters(cfg, model) if model.lora else weights.policy()
        base = frozen if model.lora else None  # (a reference copy joins the state below)
        state = create_train_state(cfg.model, tx, shardings, cfg.training.seed, params, base)
        return split_state(state)

    with phase(log, "preparing the train state", "prepared the train state"):
        params, rest, start_step = checkpoints.restore_or_init(fresh, batches)
    return join_state(params, rest, frozen), start_step


def _evaluation_hooks(setup: Setup, shardings: TrainState) -> list[Hook]:
    """The evaluations of the state after a step, in order: the validation loss (where
    training.eval_every and held-out data give one) or a policy-gradient run's validation
    rollouts (its held-out prompts), the lm-eval harness (eval.harness)."""
    hooks: list[Hook] = []
    every = setup.cfg.training.eval_every
    evaluate = make_evaluator(setup, shardings)
    if evaluate is not None:
        hooks.append(ValidationLoss(evaluate, every=every, perplexity=setup.objective.perplexity))
    if setup.rollouts is not None and setup.rollouts.validation:
        batch = setup.global_batch * setup.cfg.objective.steps_per_generation
        seed = setup.cfg.training.seed
        sample = ValidationRollouts(
            _sampler(setup), setup.rollouts.validation, batch=batch, seed=seed
        )
        hooks.append(ValidationMetrics(sample, every=every))
    harness = harness_tasks(setup.cfg, setup.model)
    if harness is not None:
        hooks.append(harness)
    return hooks


def _metrics_hooks(
    setup: Setup,
    evaluations: list[Hook],
    saves: SaveCheckpoint,
    checkpoints: RunCheckpoints,
    clock: StepClock,
    meter: ThroughputMeter,
    batches: BatchSource,
) -> list[Hook]:
    """The step's metrics, read wherever a record is written (the run's first step, every
    training.log_every steps, the last, a stop, and every evaluation), then the non-finite guard
    wherever a record is written or a checkpoint saved."""
    training = setup.cfg.training
    logged = Cadence(every=training.log_every, first=True, last=True, stop=True)
    record = AnyOf((logged, *(hook.cadence for hook in evaluations)))
    step_metrics = StepMetrics(
        record,
        clock=clock,
        meter=meter,
        tokens_per_step=setup.global_batch * setup.cfg.data.seq_len,
        batches=batches,
        objective_metrics=setup.objective.logged_names,
    )
    guard = NonfiniteGuard(
        AnyOf((record, saves.cadence)), mode=training.nonfinite, checkpoints=checkpoints
    )
    data = setup.train_data
    if data is None or isinstance(data, MixedDataset):  # a mixture has no epochs
        return [step_metrics, guard]
    return [step_metrics, guard, EpochLog(len(data), setup.global_batch, batches.position)]


def _write(
    writer: MetricsWriter, history: list[dict[str, float]], step: int, record: Mapping[str, float]
) -> None:
    history.append({"step": step, **record})
    writer.write(step, record)
