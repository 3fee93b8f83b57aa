"""A run's set-up, decided: every start-up check, the mesh, the abstract model, the objective
and the data (`prepare`), and what follows from them (the batch's shape, the FLOPs of a step,
the context-parallel split). train.describe logs it; train.compilation compiles the step from it.

Nothing here allocates a weight: `prepare` raises ConfigError before anything is compiled or
written.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from meshtrain.config.epochs import with_epoch_steps
from meshtrain.config.locations import with_absolute_paths
from meshtrain.config.pipeline import with_scan_layers
from meshtrain.config.schema import Config
from meshtrain.config.validate import check_against_mesh, check_config, micro_batch_size
from meshtrain.data import TokenDataset, build_datasets
from meshtrain.distributed.runtime import process_hosts
from meshtrain.errors import ConfigError
from meshtrain.models.abstract import (
    AbstractModel,
    abstract_model,
)
from meshtrain.observe.flops import train_flops_per_step
from meshtrain.observe.progress import phase
from meshtrain.parallel.context import ContextLayout, sequence_axes, sequence_shards
from meshtrain.parallel.mesh import MeshSpec, build_mesh, parse_mesh_shape
from meshtrain.parallel.rules import logical_to_spec, mesh_axes_for
from meshtrain.rl.rows import RowLayout, completions_per_row
from meshtrain.rl.setup import RolloutData, rollout_data
from meshtrain.train.documents import TokenFormat, token_format
from meshtrain.train.objectives import (
    OBJECTIVES,
    GroupRelative,
    Objective,
    StepInputs,
    build_objective,
)
from meshtrain.train.pipeline_plan import PipelinePlan, pipeline_plan
from meshtrain.train.step import COMPUTE_DTYPES

log = logging.getLogger(__name__)


@dataclass
class Setup:
    """Everything decided at start-up, before any compile or allocation."""

    cfg: Config
    mesh_spec: MeshSpec
    mesh: Mesh
    model: AbstractModel
    micro_batch_size: int
    train_data: TokenDataset | None  # None in a dry run, which reads no data, and for prompts
    validation_data: TokenDataset | None
    token_format: TokenFormat  # how the step reads a batch (targets with loss, documents)
    pipeline: PipelinePlan | None = None  # the pp stages' schedule (train.pipeline)
    rollouts: RolloutData | None = None  # data=prompts: what each step samples and scores

    @property
    def objective(self) -> Objective:
        """What the step minimises, reading the batches as this set-up does."""
        compute_dtype = COMPUTE_DTYPES[self.cfg.training.mixed_precision]
        moe = self.cfg.model.moe
        inputs = StepInputs(
            self.token_format,
            compute_dtype,
            self.pipeline,
            moe if moe.num_experts else None,
            self.completions_per_row,
        )
        return build_objective(inputs, self.cfg.objective)

    @property
    def completions_per_row(self) -> int:
        """A policy-gradient run's completions of one prompt per batch row (meshtrain.rl.rows);
        1 for every other run, whose rows are its sequences."""
        if self.cfg.data.source != "prompts":
            return 1
        return completions_per_row(self.cfg, self.micro_batch_size)

    @property
    def rollout_layout(self) -> RowLayout | None:
        """A policy-gradient run's rows (meshtrain.rl.rows); None for every other run."""
        objective = self.objective
        if not isinstance(objective, GroupRelative):
            return None
        return objective.layout(self.cfg.data.seq_len)

    @property
    def reference_copy(self) -> bool:
        """Whether the train state holds a frozen copy of the starting weights: the objective
        reads a reference and the model has no LoRA base to be it."""
        return self.objective.reads_reference and not self.model.lora

    @property
    def batch_shards(self) -> int:
        """The devices a batch is split over (its rule's mesh axes: dp, fsdp and ep)."""
        axes = mesh_axes_for("batch", self.cfg.model.logical_axis_rules)
        return math.prod(self.mesh.shape[axis] for axis in axes)

    @property
    def micro_global(self) -> int:
        """Sequences (a policy-gradient run: completions) per micro-batch over the whole
        mesh."""
        return self.micro_batch_size * self.batch_shards

    @property
    def global_batch(self) -> int:
        return self.micro_global * self.cfg.training.gradient_accumulation_steps

    @property
    def batch_shape(self) -> tuple[int, int, int]:
        """The train step's batch: [accumulation steps, rows per micro-batch, the objective's
        columns]: a row a sequence, or K completions (completions_per_row)."""
        accum = self.cfg.training.gradient_accumulation_steps
        rows = self.micro_global // self.completions_per_row
        return (accum, rows, self.objective.row_width(self.cfg.data.seq_len))

    @property
    def rows_sharding(self) -> NamedSharding:
        """Rows [batch, columns] split over the batch axes, as a micro-batch of the step is
        (the validation batches, the rows the reference scores)."""
        spec = logical_to_spec(("batch", None), self.cfg.model.logical_axis_rules)
        return NamedSharding(self.mesh, spec)

    @property
    def flops_per_step(self) -> int:
        """Model FLOPs of one update, all devices (meshtrain.observe.flops)."""
        layout = self.rollout_layout  # rows of several completions: their tokens
        seq_len = self.cfg.data.seq_len if layout is None else layout.tokens - 1
        accum, rows, _ = self.batch_shape
        return train_flops_per_step(self.cfg.model, seq_len=seq_len, sequences=accum * rows)


def _data_error(err: ValueError) -> ConfigError:
    """The data modules' errors name the key or file and the fix: they become exit code 2."""
    return err if isinstance(err, ConfigError) else ConfigError(str(err))


def _build_data(cfg: Config) -> tuple[TokenDataset, TokenDataset | None]:
    """The train split, and the validation split unless evaluation is off."""
    splits = ("train", "validation") if cfg.training.eval_every else ("train",)
    try:
        datasets = build_datasets(cfg.data, splits=splits, vocab_size=cfg.model.vocab_size)
    except ValueError as err:
        raise _data_error(err) from None
    return datasets["train"], datasets.get("validation")


def prepare(
    cfg: Config, devices: Sequence[jax.Device] | None = None, *, with_data: bool = True
) -> Setup:
    """All start-up checks; raises ConfigError before anything is compiled or allocated.
    (The checkpoint and initial-weight checks, which read the disk, follow in the loop's
    `_open_checkpoints`, still before any compile.)"""
    check_config(cfg)
    cfg = with_absolute_paths(cfg)  # recorded so: the run directory travels
    devices = list(devices) if devices is not None else jax.devices()
    mesh_spec = parse_mesh_shape(cfg.model.mesh_shape, len(devices), platform=devices[0].platform)
    check_against_mesh(cfg, mesh_spec)
    cfg = with_scan_layers(cfg, mesh_spec)
    mesh = build_mesh(mesh_spec, devices, hosts=process_hosts())
    compute_dtype = COMPUTE_DTYPES[cfg.training.mixed_precision]
    model = abstract_model(cfg.model, mesh, mesh_spec, compute_dtype)  # shapes: allocates nothing
    micro = micro_batch_size(cfg, mesh_spec)
    pipeline = pipeline_plan(cfg, mesh_spec)
    _check_objective_on_mesh(cfg, mesh_spec, pipeline)
    try:
        reading = token_format(cfg.data)
    except ValueError as err:
        raise _data_error(err) from None
    setup = Setup(cfg, mesh_spec, mesh, model, micro, None, None, reading, pipeline)
    if not with_data:
        return setup
    if cfg.eval.harness.tasks:  # an unknown task: one line before anything compiles
        from meshtrain.harness.run import task_manager  # lm-eval: an optional extra

        task_manager(cfg.eval.harness.tasks, cfg.eval.harness.include_path)
    if cfg.data.source == "prompts":
        with phase(log, "reading the prompts", "read the prompts"):
            try:
                setup.rollouts = rollout_data(cfg, setup.global_batch)
            except ValueError as err:
                raise _data_error(err) from None
        accum, rows, _ = setup.batch_shape
        log.info(
            "rollout rows: %d a step, each a prompt and %d of its completions in %d tokens%s",
            accum * rows,
            setup.completions_per_row,
            setup.rollout_layout.tokens,
            " (data.shared_prompt)" if setup.completions_per_row > 1 else "",
        )
        return setup
    with phase(log, f"reading the data ({cfg.data.source})", "read the data"):
        train_data, validation_data = _build_data(cfg)
        if len(train_data) == 0:
            raise ConfigError(
                f"the training documents fill no sequence of data.seq_len={cfg.data.seq_len} "
                "tokens; add documents or lower data.seq_len"
            )
    if validation_data is not None and len(validation_data) == 0:
        if cfg.training.eval_every > 0:
            log.warning(
                "data: no validation sequences (no document held out); val_loss is not logged"
            )
        validation_data = None
    setup = Setup(
        cfg,
        mesh_spec,
        mesh,
        model,
        micro,
        train_data,
        validation_data,
        dataclasses.replace(reading, pad_id=train_data.pad_id),
        pipeline,
    )
    setup.cfg = with_epoch_steps(cfg, len(train_data), setup.global_batch)  # training.epochs
    return setup


def _check_objective_on_mesh(
    cfg: Config, mesh_spec: MeshSpec, pipeline: PipelinePlan | None
) -> None:
    """The objective runs on this mesh: under its pipeline schedule, with sequences split over
    cp only where it can; else one line, before anything compiles."""
    objective = OBJECTIVES[cfg.objective.name]
    if pipeline is not None and pipeline.schedule not in objective.schedules:
        runs = ", ".join(sorted(objective.schedules)) or "no pipeline schedule"
        raise ConfigError(
            f"objective={objective.name} runs under {runs}, not model.mesh_shape's pp="
            f"{mesh_spec.size('pp')} with training.pipeline.schedule={pipeline.schedule}; "
            "use a mesh without pp (e.g. fsdp or dp instead)"
        )
    shards = sequence_shards(mesh_spec.sizes, cfg.model.logical_axis_rules)
    if shards > 1 and not objective.context_parallel:
        raise ConfigError(
            f"objective={objective.name} does not split sequences over cp (cp={shards} in "
            "model.mesh_shape); use a mesh without cp"
        )


def context_split(setup: Setup) -> tuple[ContextLayout, int] | None:
    """The layout of the cp split (parallel.context) and the bytes of keys and values each
    device all-gathers per layer and micro-batch; None without cp."""
    model, rules = setup.cfg.model, setup.cfg.model.logical_axis_rules
    shards = sequence_shards(setup.mesh_spec.sizes, rules)
    if shards == 1:
        return None
    layout = ContextLayout(
        shards, setup.cfg.data.seq_len, sequence_axes(setup.mesh_spec.sizes, rules)
    )
    kv_heads = model.num_kv_heads // setup.mesh_spec.size(*mesh_axes_for("kv_heads", rules))
    item = jnp.dtype(COMPUTE_DTYPES[setup.cfg.training.mixed_precision]).itemsize
    gathered = 2 * setup.micro_batch_size * layout.length * max(1, kv_heads) * model.head_dim
    return layout, gathered * item


def context_plan(setup: Setup) -> dict | None:
    """The cp split's numbers for the plan: shards, tokens per chunk and per device, and the
    gathered keys and values (context_split); None without cp."""
    split = context_split(setup)
    if split is None:
        return None
    layout, gathered_bytes = split
    return {
        "shards": layout.shards,
        "axes": list(layout.axes),
        "chunk": layout.chunk,
        "tokens_per_device": 2 * layout.chunk,
        "gathered_kv_bytes": gathered_bytes,
    }
