"""The start-up lines of a run, from its decided set-up (train.setup): mesh, model size, LoRA,
pipeline and context-parallel layouts, global batch and data. Logged under the set-up's name
(meshtrain.train.setup), as every start-up line is."""

from __future__ import annotations

import logging
import math

import jax

from meshtrain.data import MixedDataset
from meshtrain.models.abstract import replicated_kv_heads, whole_stacked_layers
from meshtrain.parallel.mesh import format_mesh_shape
from meshtrain.train.setup import Setup, context_split
from meshtrain.weights.lora_base import large_adapters_warning, lora_summary

log = logging.getLogger("meshtrain.train.setup")


def describe(setup: Setup) -> None:
    """The start-up lines: mesh, model size, global batch and data."""
    cfg = setup.cfg
    num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(setup.model.abstract_params))
    sizes = [setup.mesh_spec.sizes[a] for a in setup.mesh.axis_names]
    log.info(
        "mesh %s on %d %s device(s), %d process(es)",
        format_mesh_shape(sizes, setup.mesh.axis_names),
        setup.mesh.size,
        setup.mesh.devices.flat[0].platform,
        jax.process_count(),
    )
    log.info("model %s: %s parameters", cfg.model.name, f"{num_params:,}")
    if setup.model.lora:
        log.info(lora_summary(cfg.model, setup.model))
        if warning := large_adapters_warning(setup.model):
            log.warning(warning)
    if setup.pipeline is not None:
        log.info(setup.pipeline.describe())
        log.info(
            "model.scan_layers: on, for the pp stages (they hold slices of the stacked blocks)"
        )
    if split := context_split(setup):
        layout, gathered_bytes = split
        log.info(layout.describe(gathered_bytes))
    for note in (
        replicated_kv_heads(cfg.model, setup.mesh_spec),
        whole_stacked_layers(cfg.model, setup.mesh_spec),
    ):
        if note:
            log.info(note)
    log.info(
        "global batch %d sequences × %d tokens (micro_batch_size %d × %d batch shards × %d accumulation steps)",
        setup.global_batch,
        cfg.data.seq_len,
        setup.micro_batch_size,
        setup.batch_shards,
        cfg.training.gradient_accumulation_steps,
    )
    if setup.rollouts is not None:
        objective = cfg.objective
        log.info(
            "data: %d prompts; each step samples %d completions of %d of them (up to %d tokens, "
            "temperature %g), scored by %s",
            len(setup.rollouts.prompts),
            objective.num_generations,
            setup.rollouts.prompts.per_step,
            objective.max_new_tokens,
            objective.temperature,
            ", ".join(setup.rollouts.rewards.names),
        )
    if setup.train_data is not None:
        masking = "on" if setup.token_format.documents else "off"
        log.info(
            "data: %d training sequences (%s; document masking %s)",
            len(setup.train_data),
            cfg.data.source,
            masking,
        )
        if (epochs := cfg.training.epochs) is not None:
            steps, batch = cfg.training.steps, setup.global_batch
            log.info("training.epochs=%g: %d steps of %d sequences", epochs, steps, batch)
        if len(setup.train_data) < setup.global_batch:
            log.warning(
                "data: %d training sequences, fewer than one global batch of %d: each batch "
                "holds some sequences more than once; add documents or lower data.seq_len",
                len(setup.train_data),
                setup.global_batch,
            )
        mixture = setup.train_data.parts if isinstance(setup.train_data, MixedDataset) else []
        for name, source, weight in mixture:
            log.info("data: mixture source %s: weight %g, %d sequences", name, weight, len(source))
