"""The pipeline keys against the mesh: how the layers split into the stages of a pp axis
(model.pipeline.layers_per_stage), the pipeline micro-batches and the circular schedule's
repeats (training.pipeline). Each failure is a one-line ConfigError with the fix."""

from __future__ import annotations

import dataclasses

from meshtrain.config.schema import Config
from meshtrain.errors import ConfigError, require
from meshtrain.parallel.mesh import MeshSpec
from meshtrain.parallel.rules import mesh_axes_for


def with_scan_layers(cfg: Config, mesh: MeshSpec) -> Config:
    """`cfg` with model.scan_layers decided: null (the default) becomes true on a mesh with a
    pp axis, whose stages hold slices of the stacked blocks, and false otherwise."""
    if cfg.model.scan_layers is not None:
        return cfg
    model = dataclasses.replace(cfg.model, scan_layers=mesh.sizes["pp"] > 1)
    return dataclasses.replace(cfg, model=model)


def check_pipeline(cfg: Config, mesh: MeshSpec, micro_batch: int) -> None:
    """A pp axis: stacked blocks that split into the stages, pipeline micro-batches that split
    each micro-batch (`micro_batch` sequences per batch shard) into whole batch shards, and what
    the schedule needs of both."""
    model, pipeline = cfg.model, cfg.training.pipeline
    stages = mesh.sizes["pp"]
    require(
        model.lora.rank == 0 or model.lora.dropout == 0,
        f"model.lora.dropout={model.lora.dropout} with pp={stages} in model.mesh_shape: the "
        "pipeline stages do not draw adapter dropout; drop model.lora.dropout, or train on a "
        "mesh without pp (fsdp, tp and dp all support it)",
    )
    require(
        model.scan_layers is not False,
        f"model.scan_layers=false with pp={stages} in model.mesh_shape: pipeline stages hold "
        "slices of the stacked blocks; remove model.scan_layers=false (pp meshes turn it on)",
    )
    require(
        mesh_axes_for("layers", model.logical_axis_rules) == ("pp",),
        f"model.logical_axis_rules.layers={model.logical_axis_rules.get('layers')!r} with "
        f"pp={stages} in model.mesh_shape: each stage holds its own layers; set "
        "model.logical_axis_rules.layers=pp",
    )
    counts = stage_layer_counts(cfg, mesh)
    shards = mesh.size(*mesh_axes_for("batch", model.logical_axis_rules))
    rows = micro_batch * shards
    count = pipeline_microbatches(cfg, mesh)
    if rows % count or (rows // count) % shards:
        options = ", ".join(
            str(m) for m in range(1, rows + 1) if rows % m == 0 and (rows // m) % shards == 0
        )
        raise ConfigError(
            f"training.pipeline.microbatches={count} does not split the micro-batch of {rows} "
            f"sequences into whole batch shards ({shards} per pipeline micro-batch); use one of "
            f"{options}"
        )
    require(
        pipeline.schedule == "gpipe" or count >= stages,
        f"training.pipeline.microbatches={count} is fewer than the pp={stages} stages; "
        f"{pipeline.schedule} needs at least {stages}: use "
        f"training.pipeline.microbatches={2 * stages}",
    )
    if pipeline.schedule == "circular":
        require(
            len(set(counts)) == 1,
            f"model.pipeline.layers_per_stage={counts} gives stages of different sizes, which "
            "the circular schedule cannot interleave; use training.pipeline.schedule=gpipe or "
            "1f1b, or equal stages",
        )
        pipeline_repeats(cfg, mesh)


def stage_layer_counts(cfg: Config, mesh: MeshSpec) -> list[int]:
    """The layers of each pp stage: model.pipeline.layers_per_stage, else num_layers / pp
    each. Raises the one-line ConfigError of a split that does not add up."""
    stages, layers = mesh.sizes["pp"], cfg.model.num_layers
    given = cfg.model.pipeline.layers_per_stage
    balanced = [layers // stages + (s < layers % stages) for s in range(stages)]
    if given is None:
        if layers % stages == 0:
            return balanced
        options = ", ".join(str(d) for d in range(1, layers + 1) if layers % d == 0)
        uneven = f", or model.pipeline.layers_per_stage={balanced}" if stages <= layers else ""
        raise ConfigError(
            f"pp={stages} in model.mesh_shape does not split model.num_layers={layers} into "
            f"equal stages; use pp in {{{options}}}{uneven}"
        )
    counts = list(given)
    example = f"e.g. {balanced}" if stages <= layers else f"with pp at most {layers}"
    require(
        len(counts) == stages,
        f"model.pipeline.layers_per_stage={counts} lists {len(counts)} stages, but "
        f"model.mesh_shape has pp={stages}; list {stages} counts, {example}",
    )
    require(
        min(counts) >= 1,
        f"model.pipeline.layers_per_stage={counts} leaves stage {counts.index(min(counts))} "
        f"without layers; every stage needs at least one, {example}",
    )
    require(
        sum(counts) == layers,
        f"model.pipeline.layers_per_stage={counts} sums to {sum(counts)}, not "
        f"model.num_layers={layers}; {example}",
    )
    return counts


def pipeline_microbatches(cfg: Config, mesh: MeshSpec) -> int:
    """Pipeline micro-batches per micro-batch: training.pipeline.microbatches, else pp."""
    return cfg.training.pipeline.microbatches or mesh.sizes["pp"]


def pipeline_repeats(cfg: Config, mesh: MeshSpec) -> int:
    """Chunks of layers per stage: training.pipeline.repeats (circular only), else 2 or the
    smallest number above 1 that divides the layers per stage; 1 for gpipe and 1f1b. Raises
    the one-line ConfigError of repeats that do not divide the layers per stage."""
    pipeline = cfg.training.pipeline
    if pipeline.schedule != "circular":
        return 1
    stages, layers = mesh.sizes["pp"], cfg.model.num_layers
    per_stage = layers // stages
    require(
        per_stage > 1 or pipeline.repeats == 1,
        f"training.pipeline.schedule=circular loops through the layers of each stage in "
        f"chunks, but model.num_layers={layers} over pp={stages} leaves 1 per stage; use fewer "
        "stages, or training.pipeline.schedule=gpipe",
    )
    repeats = pipeline.repeats or next(r for r in range(2, per_stage + 1) if per_stage % r == 0)
    if per_stage % repeats:
        options = ", ".join(str(r) for r in range(1, per_stage + 1) if per_stage % r == 0)
        raise ConfigError(
            f"training.pipeline.repeats={repeats} does not divide the {per_stage} layers per "
            f"stage (model.num_layers={layers} over pp={stages}); use one of {options}"
        )
    return repeats
