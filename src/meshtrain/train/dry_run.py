"""`training.dry_run=true`: the real initialisation and train step (and a policy-gradient run's
sampling program, a precomputed reference's scoring program) compiled for the mesh, no weight
allocated; the memory plan logged and written to plan.json, the compile times, fusions and
attention kernel to compile.json (docs/planning.md). With plan.target, for GPUs this host lacks
(meshtrain.hardware)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

from meshtrain.config.objective import precomputed_reference
from meshtrain.config.run_record import keep_run_record
from meshtrain.config.schema import Config
from meshtrain.hardware.deviceless import (
    jax_cudnn_checks_answer_for,
    mesh_device_count,
    target_devices,
)
from meshtrain.hardware.gpu_specs import gpu_spec
from meshtrain.hardware.target import device_target
from meshtrain.models.initialization import initial_params_programs
from meshtrain.observe.compile_report import CompileReport, ProgramCompile, measure
from meshtrain.observe.memory_plan import MemoryPlan
from meshtrain.observe.metrics import setup_logging
from meshtrain.rl.rollouts import rollout_program
from meshtrain.train.compilation import (
    compile_train_step,
    inspect_compiled,
    old_log_probs_program,
)
from meshtrain.train.describe import describe
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.reference_scores import scoring_program
from meshtrain.train.setup import Setup, prepare
from meshtrain.train.state import (
    TrainState,
    abstract_train_state,
    init_compiler_options,
    state_program,
    state_shardings,
)
from meshtrain.train.step import attention_choice

log = logging.getLogger(__name__)


def dry_run(
    cfg: Config, run_dir: Path, *, devices: Sequence[jax.Device] | None = None
) -> MemoryPlan:
    """Compiles the initialisation and the train step on abstract inputs, allocating no
    weights, then logs the memory plan and the compiles and writes plan.json and compile.json
    (and communication.json with training.profile_communication)."""
    compiling_for = contextlib.nullcontext()
    if cfg.plan.target is not None:
        spec = gpu_spec(cfg.plan.target)
        devices = target_devices(spec, mesh_device_count(cfg.model.mesh_shape, spec.name))
        compiling_for = jax_cudnn_checks_answer_for(device_target(devices[0]))
    setup = prepare(cfg, devices, with_data=False)
    is_main = jax.process_index() == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir, is_main=is_main, rank=jax.process_index())
    describe(setup)
    keep_run_record(run_dir)  # checked: the plan goes into this directory
    tx = build_optimizer(cfg.training)
    # Outside the mesh's context: optax builds a placeholder state eagerly, on this host.
    shardings = state_shardings(setup.model, tx, setup.mesh, reference=setup.reference_copy)
    with jax.set_mesh(setup.mesh), compiling_for:
        start = time.perf_counter()
        # No data is read: nothing is padded, which changes neither memory nor communication.
        compiled, batch_sharding = compile_train_step(setup, tx, shardings)
        step = measure([compiled], time.perf_counter() - start)
        plan, _ = inspect_compiled(setup, compiled, tx, shardings, run_dir, is_main)
        # After the step, in a run's order (train.loop).
        init = _compile_initialisation(setup, tx, shardings)
        rollout = None
        if cfg.data.source == "prompts":
            rollout = _compile_rollout(setup, tx, shardings, batch_sharding)
        reference = None
        if precomputed_reference(cfg.objective):
            reference = _compile_reference_scoring(setup, tx, shardings)
        kernel, why = attention_choice(setup.model, cfg.training.mixed_precision)
    report = CompileReport(
        device=cfg.plan.target or setup.mesh.devices.flat[0].device_kind,
        devices=setup.mesh.size,
        num_layers=cfg.model.num_layers,
        attention=f"{kernel} ({why})",
        init=init,
        step=step,
        rollout=rollout,
        reference=reference,
    )
    for line in report.format():
        log.info(line)
    if is_main:
        report.write(run_dir / "compile.json")
    log.info("dry run: plan.json and compile.json written to %s", run_dir)
    return plan


def _compile_initialisation(
    setup: Setup, tx: optax.GradientTransformation, shardings: TrainState
) -> ProgramCompile:
    """Compiles the programs a fresh run initialises its state with (nothing runs)."""
    options = init_compiler_options(shardings)
    start = time.perf_counter()
    params = initial_params_programs(
        setup.cfg.model, setup.cfg.training.seed, shardings.params, adapters_only=setup.model.lora
    )
    lowered = [
        *(program for program in params if program is not None),
        state_program(
            tx,
            shardings,
            setup.cfg.training.seed,
            abstract_train_state(setup.model, tx, shardings).params,
        ),
    ]
    compiled = [program.compile(compiler_options=options) for program in lowered]
    return measure(compiled, time.perf_counter() - start)


def _compile_reference_scoring(
    setup: Setup, tx: optax.GradientTransformation, shardings: TrainState
) -> ProgramCompile:
    """Compiles the program that scores the pairs with the reference before training
    (objective.reference=precomputed: train.reference_scores; nothing runs)."""
    state = abstract_train_state(setup.model, tx, shardings)
    weights = state.frozen if setup.model.lora else state.params
    rows = jax.ShapeDtypeStruct(
        (setup.micro_global, setup.cfg.data.seq_len + 1), jnp.int32, sharding=setup.rows_sharding
    )
    start = time.perf_counter()
    compiled = scoring_program(setup, shardings).lower(weights, rows).compile()
    return measure([compiled], time.perf_counter() - start)


def _compile_rollout(
    setup: Setup, tx: optax.GradientTransformation, shardings: TrainState, batch_sharding: Any
) -> ProgramCompile:
    """Compiles a policy-gradient run's sampling program (meshtrain.rl.rollouts; nothing runs)
    from the train state's abstract parameters: a generation's completions, and, where it feeds
    several steps, the program that scores them by the policy that sampled them."""
    state = abstract_train_state(setup.model, tx, shardings)
    objective = setup.cfg.objective
    start = time.perf_counter()
    lowered = [
        rollout_program(
            setup.model,
            state,
            objective,
            completions=setup.global_batch * objective.steps_per_generation,
            seq_len=setup.cfg.data.seq_len,
        )
    ]
    score = old_log_probs_program(setup)
    if score is not None:
        accum, rows, _ = setup.batch_shape
        tokens = jax.ShapeDtypeStruct(
            (accum, rows, setup.rollout_layout.tokens), jnp.int32, sharding=batch_sharding
        )
        lowered.append(score.lower(state.params, state.frozen, tokens))
    return measure([program.compile() for program in lowered], time.perf_counter() - start)
