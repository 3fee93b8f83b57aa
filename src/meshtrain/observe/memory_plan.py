"""The memory plan of a run, per device: what the compiled train step needs, and whether that
fits a named accelerator. Built from shapes and shardings and from XLA's own buffer assignment
(`compiled.memory_analysis()`), so it costs a compile but never allocates the weights.

Per device:
- params, optimizer state, gradients: analytic, from each array's shape, dtype and sharding;
- arguments, outputs, temporaries: from the compiled executable. Temporaries hold the
  activations kept for the backward pass, the gathered (unsharded) weights, the gradients
  before they are reduced, and scratch. Donated outputs reuse their arguments' buffers.
- total = arguments + outputs - donated (aliased) outputs + temporaries: the peak the step needs.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from meshtrain.hardware.accelerators import accelerator_named
from meshtrain.parallel.rules import without_axes
from meshtrain.units import GIB, format_bytes, format_flops


def bytes_per_device(tree: Any, shardings: Any) -> int:
    """Bytes of one device's shards of every array in `tree` (shapes with dtypes)."""
    leaves = jax.tree.leaves(tree)
    specs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return sum(
        math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf, sharding in zip(leaves, specs, strict=True)
    )


def bytes_at(params: Any, shardings: Any, paths: tuple[tuple[str, ...], ...]) -> int:
    """Bytes of one device's shards of the parameters whose path ends in one of `paths`."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    total = 0
    for (path, leaf), sharding in zip(flat, specs, strict=True):
        names = tuple(getattr(key, "key", None) for key in path)
        if any(names[-len(end) :] == end for end in paths):
            total += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


KEY_VALUE = (("attn", "k"), ("attn", "v"))
EXPERTS = tuple(("mlp", name) for name in ("gate", "up", "down"))  # of a mixture of experts'


def unsharded_grad_bytes(params: Any, shardings: Any, axes: tuple[str, ...]) -> int:
    """Bytes per device of fp32 gradients of `params` laid out whole along the mesh `axes`
    (0 for none)."""
    if not axes:
        return 0
    whole = jax.tree.map(
        lambda s: NamedSharding(s.mesh, without_axes(s.spec, axes)),
        shardings,
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )
    fp32 = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)
    return bytes_per_device(fp32, whole)


# The rows of `MemoryPlan.format` that a run logs under the one-line summary too.
_CHOSEN_COST_ROWS = ("    key/value, whole", "    unsharded sums", "  pipeline ")


@dataclass
class MemoryPlan:
    """Bytes per device of one train step, and the verdict against a device's memory."""

    mesh: dict[str, int]
    micro_batch_size: int  # sequences per batch shard per micro-batch
    params_bytes: int
    opt_state_bytes: int
    grad_bytes: int
    activation_bytes: int  # XLA's temporaries: activations, gathered weights, raw gradients
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    collective_bytes_per_step: float  # ring-algorithm bytes, see meshtrain.communication
    flops_per_step: float  # model FLOPs per device
    device: str | None = None  # what the verdict is against
    capacity_bytes: float | None = None  # usable bytes of that device (× plan.memory_fraction)
    remat: str = "none"  # model.remat of the planned step
    scan_layers: bool = False  # model.scan_layers of the planned step
    # The key/value projections' bytes per device when tp exceeds model.num_kv_heads and they
    # are whole on every tp rank (models.abstract.fit_kv_heads); 0 when tp splits them.
    replicated_kv_bytes: int = 0
    replicated_kv_over: int = 1  # the tp ranks that each hold them whole (1: not replicated)
    # With training.sync_gradients_every > 1 or reduce_dtype=bf16: the fp32 gradient buffer
    # each device sums micro-batches in, whole along fsdp (the parameters of one replica over
    # tp); within the temporaries. 0 when gradients are reduced as they are computed.
    unsharded_grad_bytes: int = 0
    # With a pp axis: stages, microbatches, schedule, repeats, layers_per_stage, ticks, bubble
    # and microbatches_alive (the pipeline micro-batches whose activations a stage keeps at
    # once), train.pipeline_plan's.
    pipeline: dict[str, Any] | None = None
    # LoRA (model.lora): the frozen base's bytes per device as stored (within the arguments),
    # and `lora_savings`' comparison with full fine-tuning; 0 and None without LoRA.
    frozen_bytes: int = 0
    lora: dict[str, Any] | None = None
    # An objective's reference model held as a frozen copy of the starting weights (DPO without
    # LoRA: train.objectives.preference), bytes per device within the arguments; 0 without one.
    reference_bytes: int = 0
    # With a cp axis: shards, chunk (tokens per chunk), tokens_per_device and
    # gathered_kv_bytes (the keys and values each device all-gathers per layer and micro-batch,
    # within the temporaries), parallel.context's.
    context: dict[str, Any] | None = None
    # A mixture of experts' weights per device (E/ep experts; within the parameters).
    expert_bytes: int = 0

    @property
    def replicated_kv_extra_bytes(self) -> int:
        """What the replication adds per device to the parameters, over a 1/tp split (the
        gradients and each of Adam's two moments add as much again)."""
        return self.replicated_kv_bytes - self.replicated_kv_bytes // self.replicated_kv_over

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.activation_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.capacity_bytes is None else self.total_bytes <= self.capacity_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "replicated_kv_extra_bytes": self.replicated_kv_extra_bytes,
            "total_bytes": self.total_bytes,
            "fits": self.fits,
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    def levers(self) -> list[str]:
        """What would shrink the plan, the larger part first."""
        fsdp = self.mesh.get("fsdp", 1)
        sharded_state = (
            self.params_bytes
            + self.opt_state_bytes
            + self.grad_bytes
            + self.frozen_bytes
            + self.reference_bytes
        )
        if self.micro_batch_size > 1:
            smaller = (
                f"a smaller micro-batch (training.micro_batch_size={self.micro_batch_size // 2} "
                "with twice the training.gradient_accumulation_steps keeps the global batch)"
            )
        else:
            smaller = "shorter sequences (data.seq_len; the micro-batch is 1 already)"
        if self.remat != "full" or not self.scan_layers:
            smaller += " or remat (model.remat=full with model.scan_layers=true)"
        by_size = [
            (
                sharded_state,
                f"more fsdp (fsdp={fsdp} → {2 * fsdp} in model.mesh_shape halves the "
                f"{format_bytes(sharded_state)} of parameters, gradients and optimizer state)",
            ),
            (
                self.activation_bytes,
                f"{smaller}: shrinks the {format_bytes(self.activation_bytes)} of activations "
                "and temporaries",
            ),
        ]
        if self.lora and self.lora["base_dtype"] not in ("int8", "nf4"):
            by_size.append(
                (
                    self.frozen_bytes * 3 // 4,
                    f"a quantised base (model.lora.base_dtype=nf4 stores the "
                    f"{format_bytes(self.frozen_bytes)} frozen base in about a quarter of bf16)",
                )
            )
        return [text for _, text in sorted(by_size, key=lambda item: -item[0])]

    def summary(self) -> str:
        """The plan in one line, for a run on devices of no known memory size (plan.json and
        `format` hold the whole table)."""
        frozen = f"frozen base {format_bytes(self.frozen_bytes)}, " if self.lora else ""
        if self.reference_bytes:
            frozen = f"reference copy {format_bytes(self.reference_bytes)}, "
        return (
            f"memory plan per device: {format_bytes(self.total_bytes)} in all ({frozen}parameters "
            f"{format_bytes(self.params_bytes)}, optimizer state "
            f"{format_bytes(self.opt_state_bytes)}, activations + temps "
            f"{format_bytes(self.activation_bytes)}); set plan.device=h100 (or h200, a100_80gb, "
            "b200, v5e...) to check it against a device; the full table is in plan.json"
        )

    def log_lines(self, *, dry_run: bool) -> list[str]:
        """What a run logs: the whole table where it is checked against a device memory size
        (a GPU or TPU, plan.device) and in a dry run (training.dry_run); else the one line, and
        under it the rows of the costs a config chose, if any (replicated key/value
        projections, unsharded gradient sums, the pipeline)."""
        if self.fits is not None or dry_run:
            return self.format()
        chosen = [line for line in self.format() if line.startswith(_CHOSEN_COST_ROWS)]
        return [self.summary(), *chosen]

    def format(self) -> list[str]:
        """The whole table, ending in the verdict against the device (and what would shrink the
        plan when it does not fit)."""
        lines = [
            "memory plan per device "
            + f"(mesh {', '.join(f'{k}={v}' for k, v in self.mesh.items())}):",
            f"  parameters          {format_bytes(self.params_bytes):>12}",
        ]
        if self.replicated_kv_bytes:
            lines.append(
                f"    key/value, whole  {format_bytes(self.replicated_kv_bytes):>12}   "
                f"(replicated over tp={self.replicated_kv_over}: "
                f"{format_bytes(self.replicated_kv_extra_bytes)} more than a 1/tp split, "
                "as much again in gradients and in each Adam moment)"
            )
        if self.expert_bytes:
            lines.append(
                f"    experts           {format_bytes(self.expert_bytes):>12}   "
                f"(the experts this device holds: ep={self.mesh.get('ep', 1)} splits them)"
            )
        if self.lora:
            lines.append(
                f"  frozen base         {format_bytes(self.frozen_bytes):>12}   "
                f"(LoRA, stored as {self.lora['base_dtype']}; full fine-tuning would hold "
                f"{format_bytes(self.lora['full_finetune_state_bytes'])} of parameters, "
                f"gradients and optimizer state, LoRA {format_bytes(self.lora['lora_state_bytes'])})"
            )
        if self.reference_bytes:
            lines.append(
                f"  reference copy      {format_bytes(self.reference_bytes):>12}   "
                "(the objective's reference model: the starting weights, frozen)"
            )
        lines += [
            f"  optimizer state     {format_bytes(self.opt_state_bytes):>12}",
            f"  gradients           {format_bytes(self.grad_bytes):>12}   (within the temporaries)",
        ]
        if self.unsharded_grad_bytes:
            lines.append(
                f"    unsharded sums    {format_bytes(self.unsharded_grad_bytes):>12}   "
                "(summed whole along fsdp between reductions: training.sync_gradients_every, "
                "reduce_dtype; within the temporaries)"
            )
        if self.pipeline:
            pipe = self.pipeline
            repeats = f" × {pipe['repeats']} repeats" if pipe["schedule"] == "circular" else ""
            lines.append(
                f"  pipeline            {pipe['stages']} stages × {pipe['microbatches']} "
                f"micro-batches, {pipe['schedule']}{repeats}: bubble {pipe['bubble']:.1%}, "
                f"activations of {pipe['microbatches_alive']} micro-batch(es) per stage (in the "
                "temporaries)"
            )
        if self.context:
            cp = self.context
            lines.append(
                f"  context parallel    cp={cp['shards']}: {cp['tokens_per_device']} tokens of each "
                f"sequence per device, {format_bytes(cp['gathered_kv_bytes'])} of keys and values "
                "gathered per layer (in the temporaries)"
            )
        lines += [
            f"  activations + temps {format_bytes(self.activation_bytes):>12}   (XLA memory_analysis)",
            f"  total               {format_bytes(self.total_bytes):>12}   "
            f"(arguments {format_bytes(self.argument_bytes)} + outputs {format_bytes(self.output_bytes)} "
            f"- donated {format_bytes(self.alias_bytes)} + temporaries)",
            f"  collectives         {format_bytes(self.collective_bytes_per_step):>12} per step (ring)",
            f"  model FLOPs         {format_flops(self.flops_per_step):>12} per step",
        ]
        if self.fits is None:
            lines.append(
                "  verdict: no memory size known for these devices; set plan.device=h100 (or "
                "h200, a100_80gb, b200, v5e...) to check against one"
            )
        elif self.fits:
            lines.append(
                f"  verdict: fits on {self.device}: {format_bytes(self.total_bytes)} of "
                f"{format_bytes(self.capacity_bytes)} usable ({format_bytes(self.capacity_bytes - self.total_bytes)} free)"
            )
        else:
            lines.append(
                f"  verdict: does not fit on {self.device} by "
                f"{format_bytes(self.total_bytes - self.capacity_bytes)}: needs {format_bytes(self.total_bytes)} "
                f"of {format_bytes(self.capacity_bytes)} usable"
            )
            lines.extend(f"  try: {lever}" for lever in self.levers())
        return lines


def device_capacity(
    name: str | None, devices: list[jax.Device], memory_fraction: float
) -> tuple[str | None, float | None]:
    """The device the verdict is against (plan.device, else the devices in use when they report
    a memory limit) and its usable bytes."""
    if name is not None:
        accelerator = accelerator_named(name)
        return accelerator.name, accelerator.memory_gib * GIB * memory_fraction
    local = next(d for d in devices if d.process_index == jax.process_index())
    stats = local.memory_stats()
    if stats and stats.get("bytes_limit"):
        return local.device_kind, float(stats["bytes_limit"])
    return None, None


def memory_plan(
    compiled: jax.stages.Compiled,
    *,
    mesh: jax.sharding.Mesh,
    micro_batch_size: int,
    abstract_state: Any,
    state_shardings: Any,
    collective_bytes_per_step: float,
    flops_per_step: float,
    device: str | None,
    capacity_bytes: float | None,
    remat: str = "none",
    scan_layers: bool = False,
    replicated_kv_over: int = 1,
    unsharded_grad_axes: tuple[str, ...] = (),
    pipeline: dict[str, Any] | None = None,
    full_model: tuple[Any, Any] | None = None,
    base_dtype: str | None = None,
    context: dict[str, Any] | None = None,
    experts: bool = False,
) -> MemoryPlan:
    """The plan of a compiled train step whose state has these shapes and shardings;
    `replicated_kv_over`: the tp ranks that hold the key/value projections whole (1: split);
    `unsharded_grad_axes`: the mesh axes gradients are summed whole along before they are
    reduced (train.gradients), if any; `pipeline`: the pp schedule's numbers, if any. LoRA:
    `full_model`, the (shapes, shardings) of every parameter, and the base's storage;
    `context`: the cp split's numbers, if any; `experts`: the blocks' feed-forward is a mixture
    of experts. Without `full_model`, a frozen part of the state is an objective's reference
    copy of the parameters."""
    analysis = compiled.memory_analysis()
    params = bytes_per_device(abstract_state.params, state_shardings.params)
    opt_state = bytes_per_device(abstract_state.opt_state, state_shardings.opt_state)
    frozen, lora, reference = 0, None, 0
    if abstract_state.frozen is not None and full_model is None:
        reference = bytes_per_device(abstract_state.frozen, state_shardings.frozen)
    elif abstract_state.frozen is not None:
        frozen = bytes_per_device(abstract_state.frozen, state_shardings.frozen)
        lora = lora_savings(full_model, frozen, 2 * params + opt_state, base_dtype)
    replicated_kv = 0
    if replicated_kv_over > 1:
        replicated_kv = bytes_at(abstract_state.params, state_shardings.params, KEY_VALUE)
    return MemoryPlan(
        mesh={name: int(size) for name, size in mesh.shape.items()},
        micro_batch_size=micro_batch_size,
        params_bytes=params,
        opt_state_bytes=opt_state,
        grad_bytes=params,  # fp32 gradients, sharded like their parameters
        activation_bytes=int(analysis.temp_size_in_bytes),
        argument_bytes=int(analysis.argument_size_in_bytes),
        output_bytes=int(analysis.output_size_in_bytes),
        alias_bytes=int(analysis.alias_size_in_bytes),
        collective_bytes_per_step=collective_bytes_per_step,
        flops_per_step=flops_per_step,
        device=device,
        capacity_bytes=capacity_bytes,
        remat=remat,
        scan_layers=scan_layers,
        replicated_kv_bytes=replicated_kv,
        replicated_kv_over=replicated_kv_over,
        unsharded_grad_bytes=unsharded_grad_bytes(
            abstract_state.params, state_shardings.params, unsharded_grad_axes
        ),
        pipeline=pipeline,
        frozen_bytes=frozen,
        lora=lora,
        reference_bytes=reference,
        context=context,
        expert_bytes=(
            bytes_at(abstract_state.params, state_shardings.params, EXPERTS) if experts else 0
        ),
    )


def lora_savings(
    full_model: tuple[Any, Any], frozen_bytes: int, adapter_state_bytes: int, base_dtype: str
) -> dict[str, Any]:
    """What LoRA holds per device beside the activations (the frozen base, and the adapters
    with their gradients and Adam moments), against full fine-tuning's fp32 parameters,
    gradients and two moments of every parameter; bytes per device."""
    shapes, shardings = full_model
    full = 4 * bytes_per_device(
        jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), shapes), shardings
    )
    lora = frozen_bytes + adapter_state_bytes
    return {
        "base_dtype": base_dtype,
        "full_finetune_state_bytes": full,
        "lora_state_bytes": lora,
        "saved_bytes": full - lora,
    }
