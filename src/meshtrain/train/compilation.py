"""The train step compiled from shapes and shardings alone (no weight allocated), and what the
compiled step tells: its memory plan and collectives (plan.json, communication.json), and the
throughput meter of its FLOPs. Logged under the set-up's name (meshtrain.train.setup), as every
start-up line is."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.config.objective import generation_cycle
from meshtrain.distributed.runtime import process_hosts
from meshtrain.models.abstract import key_value_replicas
from meshtrain.observe.communication import CommunicationReport, account_collectives
from meshtrain.observe.memory_plan import MemoryPlan, device_capacity, memory_plan
from meshtrain.observe.progress import phase
from meshtrain.observe.throughput import ThroughputMeter, peak_flops_per_device
from meshtrain.parallel.rules import logical_to_spec
from meshtrain.train.gradients import gradient_sync
from meshtrain.train.objectives.policy_gradient import sampling_log_probs
from meshtrain.train.optimizer import learning_rate_schedule
from meshtrain.train.setup import Setup, context_plan
from meshtrain.train.state import TrainState, abstract_train_state
from meshtrain.train.step import make_train_step
from meshtrain.units import format_flops

log = logging.getLogger("meshtrain.train.setup")


def compile_train_step(
    setup: Setup, tx: optax.GradientTransformation, shardings: TrainState
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
        setup.model,
        tx,
        learning_rate_schedule(cfg.training),
        state_shardings=shardings,
        batch_sharding=batch_sharding,
        objective=setup.objective,
        training=cfg.training,
    )
    abstract_batch = jax.ShapeDtypeStruct(setup.batch_shape, np.int32, sharding=batch_sharding)
    with phase(log, "compiling the train step", "compiled the train step"):
        compiled = train_step.lower(
            abstract_train_state(setup.model, tx, shardings), abstract_batch
        ).compile()
    return compiled, batch_sharding


def inspect_compiled(
    setup: Setup,
    compiled: jax.stages.Compiled,
    tx: optax.GradientTransformation,
    shardings: TrainState,
    run_dir: Path,
    is_main: bool,
) -> tuple[MemoryPlan, CommunicationReport]:
    """Logs the compiled step's memory plan (the whole table against a known device memory
    size or in a dry run, else one line) and, with training.profile_communication, every
    collective; writes plan.json (and communication.json)."""
    cfg = setup.cfg
    communication = account_collectives(compiled.as_text(), setup.mesh)
    device, capacity = device_capacity(
        cfg.plan.device or cfg.plan.target,
        list(setup.mesh.devices.flat),
        cfg.plan.memory_fraction,
    )
    plan = memory_plan(
        compiled,
        mesh=setup.mesh,
        micro_batch_size=setup.micro_batch_size,
        abstract_state=abstract_train_state(setup.model, tx, shardings),
        state_shardings=shardings,
        collective_bytes_per_step=communication.ring_bytes_per_step,
        flops_per_step=setup.flops_per_step / setup.mesh.size,
        device=device,
        capacity_bytes=capacity,
        remat=cfg.model.remat,
        scan_layers=cfg.model.scan_layers,
        replicated_kv_over=key_value_replicas(cfg.model, setup.mesh_spec),
        unsharded_grad_axes=gradient_sync(
            cfg.training, setup.mesh, cfg.model.logical_axis_rules
        ).shards,
        pipeline=None if setup.pipeline is None else setup.pipeline.to_json(),
        full_model=(
            (setup.model.abstract_params, setup.model.param_shardings) if setup.model.lora else None
        ),
        base_dtype=cfg.model.lora.base_dtype,
        context=context_plan(setup),
        experts=cfg.model.moe.num_experts > 0,
    )
    lines = plan.log_lines(dry_run=cfg.training.dry_run)
    if cfg.training.profile_communication:
        lines += communication.format()
    for line in lines:
        log.info(line)
    if is_main:
        plan.write(run_dir / "plan.json")
        if cfg.training.profile_communication:
            communication.write(run_dir / "communication.json")
    return plan, communication


def throughput_meter(setup: Setup) -> ThroughputMeter:
    """Tokens/s, TFLOP/s and MFU against the devices' peak (logged once, with its source)."""
    devices = list(setup.mesh.devices.flat)
    peak, source = peak_flops_per_device(
        devices, setup.cfg.training.mixed_precision, hosts=process_hosts()
    )
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


def old_log_probs_program(setup: Setup) -> Callable[[Any, Any, jax.Array], jax.Array] | None:
    """The program that scores a policy-gradient run's generation by the policy that sampled it
    (train.objectives.policy_gradient.sampling_log_probs; its output on every process), where a
    generation feeds several steps (objective.num_iterations × steps_per_generation > 1)."""
    if generation_cycle(setup.cfg.objective) == 1:
        return None
    everywhere = NamedSharding(setup.mesh, PartitionSpec())
    score = sampling_log_probs(setup.objective.inputs, setup.model)
    return jax.jit(score, out_shardings=everywhere)
