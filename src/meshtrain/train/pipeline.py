"""Pipeline parallelism over the `pp` mesh axis: the stacked blocks split into stages, the
micro-batch split into pipeline micro-batches that flow through them.

The stacked blocks (model.scan_layers) are stored with their first axis split over `pp` (logical
axis `layers`): stage s stores layers [s·L/S, (s+1)·L/S) and their optimizer state; the saved
layout is the one without pp. Within a stage, fsdp, tp and dp shard as everywhere else. Every
stage holds the embedding, final norm and head (sharded over fsdp and tp as usual); the loss is
computed with its rows split over pp as well (`loss_rules`).

Where a stage runs other layers than it stores, the step first moves the compute-dtype weights
into stage order (`layer_table`): the circular schedule's interleaved chunks are one all-to-all
over pp per step; uneven stages (model.pipeline.layers_per_stage) gather the layers each stage
runs, its slots beyond its own count computed and discarded. Gradients flow back by transpose.

The stages run inside one `jax.shard_map` that is manual over `pp` only. Each tick, every stage
runs its layers on its activations, then `jax.lax.ppermute` hands them to the next stage.
Schedules (training.pipeline.schedule):

- **gpipe**: the forwards of all M pipeline micro-batches, M + S - 1 ticks; the backward pass is
  JAX's transpose of that loop, so the activations of all M micro-batches are kept.
- **circular**: gpipe with each stage's layers in R chunks (training.pipeline.repeats), stage s
  holding chunks s, S + s, 2S + s...; a micro-batch leaving the last stage goes round to the
  first again until it has passed R times: R·M + S - 1 ticks of 1/R of the layers each.
- **1f1b**: one forward and one backward per tick (masked where a stage has no micro-batch), the
  backward of a micro-batch starting at the last stage right after its forward: a stage keeps
  the inputs of at most 2S - 1 micro-batches, whatever M is, and recomputes its forward in the
  backward (jax.vjp), as model.remat=full would.

Every stage computes at every tick, the ticks without a micro-batch being discarded: the bubble
is the share of such ticks (train.pipeline_plan). With LoRA only the adapters are differentiated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from meshtrain.models.attention import AttentionKernel
from meshtrain.models.interface import LanguageModel
from meshtrain.models.lora import join_adapters
from meshtrain.parallel.rules import Rules, mesh_axes_for
from meshtrain.train.pipeline_plan import AXIS, PipelinePlan, layer_table


def _on_stages(a: jax.Array) -> jax.Array:
    """`a` [S·R·C, ...] with its first axis split over pp (the rest as XLA chooses)."""
    spec = PartitionSpec(AXIS, *[PartitionSpec.UNCONSTRAINED] * (a.ndim - 1))
    return jax.lax.with_sharding_constraint(a, spec)


def arrangement(plan: PipelinePlan, table: np.ndarray) -> Callable[[Any], Any] | None:
    """stacked block leaves [L, ...] → [S·R·C, ...] in stage order (layer_table, flattened),
    or None where that is the stored order (even stages, one repeat). Circular: [R, S, C] →
    [S, R, C], one all-to-all over pp; uneven: a gather of each stage's layers (XLA gathers
    the stored blocks over pp first: the compute-dtype blocks of every stage, transiently)."""
    stages, repeats, width = table.shape
    if repeats > 1:

        def move(a: jax.Array) -> jax.Array:
            chunks = a.reshape(repeats, stages, width, *a.shape[1:]).swapaxes(0, 1)
            return _on_stages(chunks.reshape(a.shape))

    elif plan.layers_per_stage:
        index = np.maximum(table.ravel(), 0)

        def move(a: jax.Array) -> jax.Array:
            return _on_stages(jnp.take(a, index, axis=0))

    else:
        return None
    return lambda tree: jax.tree.map(move, tree)


def loss_rules(rules: Rules, plan: PipelinePlan) -> Rules:
    """The rules of the loss after the stages: its rows split over pp too where the pipeline
    micro-batches divide over the stages (each stage then computes the loss of M / S of them),
    else as `rules` (every stage computes all of it)."""
    if plan.microbatches % plan.stages:
        return rules
    return {**rules, "batch": [AXIS, *mesh_axes_for("batch", rules)]}


def _to_next_stage(x: jax.Array, stages: int) -> jax.Array:
    return jax.lax.ppermute(x, AXIS, [(s, (s + 1) % stages) for s in range(stages)])


def _to_previous_stage(x: jax.Array, stages: int) -> jax.Array:
    return jax.lax.ppermute(x, AXIS, [((s + 1) % stages, s) for s in range(stages)])


def _hand_over(y: jax.Array, dx: jax.Array, kept: Any, stages: int) -> tuple[Any, Any, Any]:
    """1F1B's hand-overs (y on, then dx back) after the tick's other collectives and before the
    next's: else XLA's CPU runtime may deadlock a permute against a stage's tp collective."""
    y, dx, kept = jax.lax.optimization_barrier((y, dx, kept))
    arrived = _to_next_stage(y, stages)
    arrived, dx = jax.lax.optimization_barrier((arrived, dx))
    returned = _to_previous_stage(dx, stages)
    return jax.lax.optimization_barrier((arrived, returned, kept))


def _stage_runner(net: LanguageModel, kernel: AttentionKernel) -> Callable[..., jax.Array]:
    """(stage's stacked block state, its kinds int32 [layers], which of its slots hold a layer
    bool [layers] or None for all, x [b, T, D], positions [b, T], segment_ids [b, T] or None)
    → x after the stage's layers."""
    graphdef = nnx.graphdef(net.blocks)

    def run(stacked: Any, kinds: jax.Array, active, x: jax.Array, positions, segment_ids):
        per_kind = net.rope_per_kind(positions)
        x, _ = net.scan_blocks(  # no routing statistics: pp refuses a mixture of experts
            graphdef, stacked, x, per_kind, kinds, kernel, segment_ids, active=active
        )
        return x

    return run


def _stage_layers(
    net: LanguageModel, plan: PipelinePlan
) -> tuple[Callable[[Any], Any] | None, jax.Array, jax.Array | None]:
    """The blocks' move into stage order (`arrangement`, None: as stored), and in stage order
    each slot's layer kind int32 [S·R·C] and, for uneven stages, whether it holds a layer
    bool [S·R·C] (None: every slot does)."""
    table = layer_table(plan, len(net.kind_index))
    kinds = jnp.asarray(np.asarray(net.kind_index)[np.maximum(table, 0)].ravel(), jnp.int32)
    active = jnp.asarray(table >= 0).ravel() if plan.layers_per_stage else None
    return arrangement(plan, table), kinds, active


def _chunk(tree: Any, repeat: jax.Array, repeats: int) -> Any:
    """A circular stage's chunk `repeat` of its [R·C, ...] leaves: rows [repeat·C, +C)."""
    if repeats == 1:
        return tree

    def rows(a: jax.Array) -> jax.Array:
        width = a.shape[0] // repeats
        return jax.lax.dynamic_slice_in_dim(a, repeat * width, width)

    return jax.tree.map(rows, tree)


def _varying(tree: Any) -> Any:
    """`tree` typed as differing between stages (a loop carry that becomes stage-local). Cast
    in fp32: the transpose of the cast is a sum over pp, and XLA's CPU compiler aborts on a
    bf16 one ("Invalid binary instruction opcode copy")."""

    def cast(a: jax.Array) -> jax.Array:
        if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype.itemsize >= 4:
            return jax.lax.pcast(a, (AXIS,), to="varying")
        return jax.lax.pcast(a.astype(jnp.float32), (AXIS,), to="varying").astype(a.dtype)

    return jax.tree.map(cast, tree)


def _sum_over_stages(tree: Any, scatter: bool = False) -> Any:
    """psum over pp (psum_scatter of the leading axis with `scatter`), each leaf in its own
    dtype but summed in fp32: XLA's CPU compiler aborts on a bf16 reduction over pp."""

    def reduce(a: jax.Array) -> jax.Array:
        wide = a.astype(jnp.float32)
        if scatter:
            wide = jax.lax.psum_scatter(wide, AXIS, scatter_dimension=0, tiled=True)
        else:
            wide = jax.lax.psum(wide, AXIS)
        return wide.astype(a.dtype)

    return jax.tree.map(reduce, tree)


def _store(buffer: jax.Array, index: jax.Array, value: jax.Array, keep: jax.Array) -> jax.Array:
    """buffer[index] = value where `keep`, else buffer unchanged."""
    old = jax.lax.dynamic_index_in_dim(buffer, index, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(keep, value, old), index, 0)


def _add_where(totals: Any, values: Any, on: jax.Array) -> Any:
    """totals + values (in fp32) where `on`, else totals."""
    add = lambda total, v: total + jnp.where(on, v.astype(jnp.float32), 0.0)  # noqa: E731
    return jax.tree.map(add, totals, values)


def _split(a: jax.Array | None, count: int) -> jax.Array | None:
    """[B, ...] → [count, B / count, ...]: pipeline micro-batch i is rows [i·b, (i+1)·b)."""
    return None if a is None else a.reshape(count, a.shape[0] // count, *a.shape[1:])


def _microbatch(a: jax.Array | None, i: jax.Array) -> jax.Array | None:
    return None if a is None else jax.lax.dynamic_index_in_dim(a, i, keepdims=False)


def pipelined_hidden(
    net: LanguageModel,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    plan: PipelinePlan,
    kernel: AttentionKernel,
) -> jax.Array:
    """The blocks of `net` run as a GPipe or circular pipeline: x [B, T, D] (embedded) →
    [B, T, D] (before the final norm), positions and segment_ids int32 [B, T] (segment_ids may
    be None).

    Tick t, stage s runs item t - s: repeat (t - s) // M of micro-batch (t - s) % M. A circular
    micro-batch leaving the last stage reaches the first at tick item + S and waits there for
    its next pass (M ≥ S ticks later). The result's rows are split over pp (each stage receives
    M / S pipeline micro-batches by a reduce-scatter) where M divides over the stages, else
    every stage holds all of them."""
    stages, count, repeats = plan.stages, plan.microbatches, plan.repeats
    items = repeats * count
    scatter = count % stages == 0
    run_stage = _stage_runner(net, kernel)
    arrange, kinds, active = _stage_layers(net, plan)
    stacked = nnx.state(net.blocks)
    stacked = stacked if arrange is None else arrange(stacked)

    def body(stacked, kinds, active, xs, positions, segment_ids):
        stage = jax.lax.axis_index(AXIS)
        xs = _varying(xs)  # read by stage 0 only; explicit, for the fp32 sum of its transpose

        def tick(carry, t):
            arrived, waiting, outputs = carry
            item = jnp.clip(t - stage, 0, items - 1)
            repeat, index = item // count, item % count
            fresh = _microbatch(xs, index)
            if repeats > 1:  # stage 0: outputs of the last stage wait for their next pass
                back = t - stages
                returning = (stage == 0) & (back >= 0) & (back < items - count)
                waiting = _store(waiting, jnp.clip(back, 0, items - 1) % count, arrived, returning)
                fresh = jnp.where(repeat == 0, fresh, _microbatch(waiting, index))
            y = run_stage(
                _chunk(stacked, repeat, repeats),
                _chunk(kinds, repeat, repeats),
                _chunk(active, repeat, repeats),
                jnp.where(stage == 0, fresh, arrived),
                _microbatch(positions, index),
                _microbatch(segment_ids, index),
            )
            done = (stage == stages - 1) & (t - stage >= items - count) & (t - stage < items)
            outputs = _store(outputs, index, y, done)
            return (_to_next_stage(y, stages), waiting, outputs), None

        waiting = jnp.zeros_like(xs) if repeats > 1 else None
        start = (jnp.zeros_like(xs[0]), waiting, jnp.zeros_like(xs))  # stage-local, as xs is
        (_, _, outputs), _ = jax.lax.scan(tick, start, jnp.arange(plan.ticks))
        return _sum_over_stages(outputs, scatter=scatter)

    layers = PartitionSpec(AXIS)
    shared = PartitionSpec()
    pipelined = jax.shard_map(
        body,
        in_specs=(layers, layers, layers, shared, shared, shared),
        out_specs=layers if scatter else shared,
        axis_names={AXIS},
    )
    hidden = pipelined(
        stacked,
        kinds,
        active,
        _split(x, count),
        _split(positions, count),
        _split(segment_ids, count),
    )
    return hidden.reshape(x.shape)


def one_f_one_b(
    net: LanguageModel,
    params: Any,
    embed: Callable[[Any], jax.Array],
    head_loss: Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array],
    targets: jax.Array,
    mask: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    plan: PipelinePlan,
    kernel: AttentionKernel,
    frozen: Any = None,
) -> tuple[jax.Array, Any]:
    """Summed loss and its gradients, by the 1F1B schedule. `params`: the compute-dtype
    parameters `net` holds, outer ones all but `blocks` (with LoRA's `frozen` base: the
    adapters, the only ones differentiated). embed(outer) → tokens embedded [B, T, D];
    head_loss(outer, hidden [b, T, D], targets [b, T], mask [b, T]) → a pipeline micro-batch's
    summed loss; targets, positions, segment_ids int32 [B, T], mask fp32 [B, T]. Returns (loss,
    fp32 gradients like `params`).

    Tick t, stage s runs the forward of micro-batch t - s and the backward of micro-batch
    t - 2(S - 1) + s; the last stage takes a micro-batch's loss and gradient right after its
    forward; a backward recomputes the stage's forward from the input it saved (a ring of
    2S - 1 slots). Idle ticks are masked out, not skipped: under a lax.cond per stage, the fsdp
    and tp collectives inside the branches deadlocked XLA's CPU runtime (8 faked devices)."""
    stages, count = plan.stages, plan.microbatches
    slots = min(count, 2 * stages - 1)
    run_stage = _stage_runner(net, kernel)
    lora = frozen is not None
    outer = {k: v for k, v in (frozen if lora else params).items() if k != "blocks"}
    arrange, kinds, active = _stage_layers(net, plan)
    in_stage_order = (lambda tree: tree) if arrange is None else arrange
    blocks = in_stage_order(params["blocks"])
    frozen_blocks = in_stage_order(frozen["blocks"]) if lora else {}
    xs, embed_vjp = jax.vjp(embed, outer)

    def body(weights, kinds, active, outer, xs, positions, segment_ids, targets, mask):
        (stacked, frozen_stacked), stage = weights, jax.lax.axis_index(AXIS)
        xs, last = _varying(xs), stage == stages - 1  # xs: read by stage 0 only
        zeros_x = jnp.zeros_like(xs[0])  # typed as stage-local, like the loop's values (xs is)
        f32 = lambda tree: _varying(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree))  # noqa: E731

        def forward(stacked, x, index):
            return run_stage(
                join_adapters(stacked, frozen_stacked) if lora else stacked,
                kinds,
                active,
                x,
                _microbatch(positions, index),
                _microbatch(segment_ids, index),
            )

        def tick(carry, t):
            arrived, returned, saved, stage_grads, outer_grads, dxs, loss_sum = carry
            # The forward of micro-batch f = t - s.
            f = t - stage
            f_on = (f >= 0) & (f < count)
            fi = jnp.clip(f, 0, count - 1)
            x = jnp.where(stage == 0, _microbatch(xs, fi), arrived)
            y = forward(stacked, x, fi)
            saved = _store(saved, fi % slots, x, f_on)

            # The last stage: the loss of micro-batch f and its gradient, right away.
            # Differentiated as a stage-local copy: its gradient is this stage's alone.
            loss, (d_outer, dy) = jax.value_and_grad(head_loss, argnums=(0, 1))(
                _varying(outer), y, _microbatch(targets, fi), _microbatch(mask, fi)
            )
            if lora:  # the outer parameters are frozen: no gradient is kept for them
                d_outer = outer_grads
            loss_sum, outer_grads = _add_where(
                (loss_sum, outer_grads), (loss, d_outer), last & f_on
            )

            # The backward of micro-batch g = t - 2(S - 1) + s: at the last stage g = f.
            g = t - 2 * (stages - 1) + stage
            g_on = (g >= 0) & (g < count)
            gi = jnp.clip(g, 0, count - 1)
            cotangent = jnp.where(last, dy, returned)

            x_saved = jax.lax.dynamic_index_in_dim(saved, gi % slots, keepdims=False)
            _, vjp = jax.vjp(lambda p, x: forward(p, x, gi), stacked, x_saved)
            d_stacked, dx = vjp(cotangent)
            stage_grads = _add_where(stage_grads, d_stacked, g_on)
            dxs = _store(dxs, gi, dx, (stage == 0) & g_on)
            kept = (saved, stage_grads, outer_grads, dxs, loss_sum)
            arrived, returned, kept = _hand_over(y, dx, kept, stages)
            return (arrived, returned, *kept), None

        start = (
            zeros_x,
            zeros_x,
            _varying(jnp.zeros((slots, *xs.shape[1:]), xs.dtype)),
            f32(stacked),
            f32({} if lora else outer),
            jnp.zeros_like(xs),
            f32(jnp.zeros(())),
        )
        carry, _ = jax.lax.scan(tick, start, jnp.arange(plan.ticks))
        _, _, _, stage_grads, outer_grads, dxs, loss_sum = carry
        # Only the last stage holds the loss and the head's gradients, only the first dxs.
        return stage_grads, *_sum_over_stages((outer_grads, dxs, loss_sum))

    layers, replicated = PartitionSpec(AXIS), PartitionSpec()
    pipelined = jax.shard_map(
        body,
        in_specs=(layers, layers, layers, *(replicated,) * 6),
        out_specs=(layers, replicated, replicated, replicated),
        axis_names={AXIS},
    )
    stage_grads, outer_grads, dxs, loss = pipelined(
        (blocks, frozen_blocks),
        kinds,
        active,
        outer,
        _split(xs, count),
        _split(positions, count),
        _split(segment_ids, count),
        _split(targets, count),
        _split(mask, count),
    )
    if arrange is not None:  # back from stage order to the stored one, in fp32
        stored = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), params["blocks"]
        )
        (stage_grads,) = jax.linear_transpose(arrange, stored)(stage_grads)
    if lora:
        return loss, {"blocks": stage_grads}
    (embed_grads,) = embed_vjp(dxs.reshape(xs.shape))
    outer_grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), outer_grads, embed_grads)
    return loss, {**outer_grads, "blocks": stage_grads}
