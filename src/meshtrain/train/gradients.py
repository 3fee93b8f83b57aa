"""An update's gradients: summed over its micro-batches and reduced over the batch axes.

Batches are int32 [accum, micro_global, seq_len + 1]. Two ways to reduce, chosen once per run
by `gradient_sync` from `training.gradient_accumulation_steps`, `training.sync_gradients_every`
and `training.reduce_dtype`:

- **implicit** (the default where nothing below applies): each micro-batch's gradient is
  constrained to its parameter's sharding, so XLA reduces it over every batch axis (a
  reduce-scatter over fsdp, an all-reduce over dp) once per micro-batch, in the dtype it was
  computed in.
- **grouped**: the micro-batch is split into groups, one per device group of the `grouped` batch
  axes, and `jax.vmap(..., spmd_axis_name=grouped)` computes one gradient per group
  ([groups, *param], the group axis sharded over `grouped`): nothing is reduced over those axes
  until this module says so.
  - dp (replicas) is always grouped there: each replica sums its own gradients over all
    micro-batches and the dp all-reduce runs once per update, after the last one.
  - fsdp is grouped too with `sync_gradients_every=k > 1` (or `reduce_dtype=bf16`): each device
    sums k micro-batches' gradients unsharded over fsdp (a buffer of the parameters' size over
    tp), then one reduce-scatter over fsdp folds them into the sharded sum: k times fewer fsdp
    reductions for that buffer.
  - `reduce_dtype=bf16` casts each explicit reduction's input to bf16 (half the bytes on the
    wire) and the result back to fp32 before it is added to the fp32 sums.

Both give the same sums up to the order of fp32 additions (tests/train/test_gradients.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.config.schema import ReduceDtype, TrainingConfig
from meshtrain.parallel.rules import Rules, active_axes, mesh_axes_for, without_axes

REDUCE_DTYPES: dict[ReduceDtype, jnp.dtype] = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
REPLICA_AXES = ("dp",)  # batch axes that hold whole replicas: reduced once per update

# The sums an objective returns for some rows (train.objectives): "loss" (summed), "count" (what
# the loss is averaged over: trained tokens, pairs...) and its metrics' own sums, all fp32 [];
# the sums of the micro-batches and devices add up to those of the update.
Sums = dict[str, jax.Array]
# (params, rows, frozen) → (sums, gradients of sums["loss"] with respect to params). rows:
# tokens [B, seq_len + 1], or a tuple of arrays [B, ...] (with LoRA dropout: the tokens and each
# row's key); frozen: what the loss reads but does not differentiate (a LoRA run's base), or None.
LossAndGrads = Callable[[Any, Any, Any], tuple[Sums, Any]]
# (params, batch: rows with two leading axes [accum, micro_global, ...], frozen)
#   → (summed gradients, summed sums)
Accumulate = Callable[[Any, Any, Any], tuple[Any, Sums]]


@dataclass(frozen=True)
class GradientSync:
    """Where and how often an update's gradients are reduced over the batch axes."""

    grouped: tuple[str, ...]  # batch axes reduced explicitly, here; () for the implicit path
    replicas: tuple[str, ...]  # of those, the replica axes (dp): reduced once per update
    every: int  # micro-batches summed unsharded between fsdp reductions
    reduce_dtype: jnp.dtype  # of the explicit reductions

    @property
    def shards(self) -> tuple[str, ...]:
        """The grouped axes that shard the parameters (fsdp): reduced every `every` micro-batches."""
        return tuple(a for a in self.grouped if a not in self.replicas)


def gradient_sync(training: TrainingConfig, mesh: jax.sharding.Mesh, rules: Rules) -> GradientSync:
    """The reduction plan of a run: which batch axes (of size > 1) are reduced explicitly."""
    reduce_dtype = REDUCE_DTYPES[training.reduce_dtype]
    batch_axes = active_axes(mesh_axes_for("batch", rules), mesh.shape)
    if mesh.shape.get("pp", 1) > 1:  # the pipeline's shard_map is not vmapped: implicit path
        batch_axes = ()
    replicas = tuple(a for a in batch_axes if a in REPLICA_AXES)
    shards = tuple(a for a in batch_axes if a not in REPLICA_AXES)
    explicit_shards = training.sync_gradients_every > 1 or reduce_dtype != jnp.float32
    deferred_replicas = training.gradient_accumulation_steps > 1 or reduce_dtype != jnp.float32
    grouped_replicas = replicas if deferred_replicas or (explicit_shards and shards) else ()
    grouped = tuple(
        a for a in batch_axes if a in grouped_replicas or (explicit_shards and a in shards)
    )
    return GradientSync(
        grouped=grouped,
        replicas=tuple(a for a in grouped if a in replicas),
        every=training.sync_gradients_every,
        reduce_dtype=reduce_dtype,
    )


def _leading(axes: tuple[str, ...], sharding: NamedSharding) -> NamedSharding:
    """`sharding` with a new leading dimension split over `axes`."""
    return NamedSharding(sharding.mesh, PartitionSpec(axes, *without_axes(sharding.spec, axes)))


def _add(a: Any, b: Any, shardings: Any) -> Any:
    return jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, a, b), shardings)


def implicit_accumulate(loss_and_grads: LossAndGrads, param_shardings: Any) -> Accumulate:
    """Gradients reduced by XLA at every micro-batch (the constraint to the parameters'
    shardings). One micro-batch: no loop and no zero-filled sum; several: a lax.scan over all
    of them from zeros (peeling the first one off measured 10% more temporaries)."""

    def accumulate(params: Any, batch: Any, frozen: Any) -> tuple[Any, Sums]:
        def micro_grads(tokens: Any) -> tuple[Any, Sums]:
            sums, grads = loss_and_grads(params, tokens, frozen)
            return jax.lax.with_sharding_constraint(grads, param_shardings), sums

        return _summed(micro_grads, batch, param_shardings, peel=False)

    return accumulate


def grouped_accumulate(
    loss_and_grads: LossAndGrads, param_shardings: Any, sync: GradientSync
) -> Accumulate:
    """Gradients computed per device group of `sync.grouped`, summed there and reduced
    explicitly: over fsdp every `sync.every` micro-batches, over dp once at the end.
    `loss_and_grads` must split the batch over the other batch axes only
    (models.abstract.without_mesh_axes)."""
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    groups, replicas = size(sync.grouped), size(sync.replicas)
    per_group = jax.vmap(loss_and_grads, in_axes=(None, 0, None), spmd_axis_name=sync.grouped)
    group_shardings = jax.tree.map(lambda s: _leading(sync.grouped, s), param_shardings)
    # The running sum: [replicas, *param] per replica (dp), else the parameters' own layout.
    if sync.replicas:
        sum_shardings = jax.tree.map(lambda s: _leading(sync.replicas, s), param_shardings)
    else:
        sum_shardings = param_shardings

    def reduce(grads: Any, axis: int, shardings: Any) -> Any:
        """Sums `axis` in the reduce dtype (the collective), back to fp32 in `shardings`."""

        def one(grad: jax.Array, sharding: NamedSharding) -> jax.Array:
            reduced = jnp.sum(grad.astype(sync.reduce_dtype), axis=axis)
            return jax.lax.with_sharding_constraint(reduced, sharding).astype(grad.dtype)

        return jax.tree.map(one, grads, shardings)

    def fold(grads: Any) -> Any:
        """A window's per-group sums [replicas × shards, *param] in the running sum's layout:
        summed over the parameter-sharding axes (one reduce-scatter per array)."""
        if not sync.shards:
            return grads
        if not sync.replicas:
            return reduce(grads, 0, sum_shardings)
        split = lambda g: g.reshape(replicas, groups // replicas, *g.shape[1:])  # noqa: E731
        return reduce(jax.tree.map(split, grads), 1, sum_shardings)

    def accumulate(params: Any, batch: Any, frozen: Any) -> tuple[Any, Sums]:
        def micro_grads(tokens: Any) -> tuple[Any, Sums]:
            """[micro_global, ...] → ([groups, *param] gradients, the groups' sums added)."""
            tokens = _leading_split(tokens, groups)  # [groups, rows, ...]
            sums, grads = per_group(params, tokens, frozen)
            grads = jax.lax.with_sharding_constraint(grads, group_shardings)
            return grads, jax.tree.map(jnp.sum, sums)

        def window(tokens: Any) -> tuple[Any, Sums]:
            """[every, micro_global, ...] → the window's sums, folded."""
            grads, sums = _summed(micro_grads, tokens, group_shardings)
            return fold(grads), sums

        windows = _leading_split(batch, -1, sync.every)  # [accum / every, every, ...]
        # Zeros start the windows' sum: a peeled first window would be a second copy of the
        # whole pass, and XLA keeps both programs' buffers (measured: +60% temporaries).
        grads, sums = _summed(window, windows, sum_shardings, peel=False)
        if sync.replicas:  # the one reduction over the replicas of this update
            grads = reduce(grads, 0, param_shardings)
        return grads, sums

    return accumulate


def _leading_split(rows: Any, first: int, second: int | None = None) -> Any:
    """Each array of `rows` with its leading axis split in two: [first, rest] or
    [first (-1: the rest), second]."""

    def split(a: jax.Array) -> jax.Array:
        shape = (first, -1) if second is None else (first, second)
        return a.reshape(*shape, *a.shape[1:])

    return jax.tree.map(split, rows)


def _summed(
    part: Callable[[Any], tuple[Any, Sums]],
    parts: Any,
    shardings: Any,
    *,
    peel: bool = True,
) -> tuple[Any, Sums]:
    """The sums of `part` (gradients, and the objective's sums) over the leading axis of the
    arrays of `parts`, in a lax.scan (none for one part). peel: the first part starts the sums
    (no zero-filled buffer); else they start from zeros in `shardings`."""
    first = jax.tree.map(lambda a: a[0], parts)
    if jax.tree.leaves(parts)[0].shape[0] == 1:
        return part(first)
    if peel:
        init, rest = part(first), jax.tree.map(lambda a: a[1:], parts)
    else:
        shapes = jax.eval_shape(part, first)
        zeros = lambda a, s=None: jnp.zeros(a.shape, a.dtype, device=s)  # noqa: E731
        init = (jax.tree.map(zeros, shapes[0], shardings), jax.tree.map(zeros, shapes[1]))
        rest = parts

    def body(carry, item):
        grad_sum, sums_so_far = carry
        grads, sums = part(item)
        sums = jax.tree.map(jnp.add, sums_so_far, sums)
        return (_add(grad_sum, grads, shardings), sums), None

    return jax.lax.scan(body, init, rest)[0]
