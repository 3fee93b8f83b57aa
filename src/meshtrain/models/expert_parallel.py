"""Expert parallelism: a mixture of experts' layer with its experts split over the ep mesh axis
(models.moe.MoeFeedForward), its tokens brought to the devices holding their experts and the
outputs brought back, in a shard_map manual over every mesh axis. Two ways, by the layer's mode:

- capacity mode (exchanging_buffers): each device fills its tokens' buffers for every expert,
  [E, S·C, D] (models.capacity), and one all-to-all over ep sends each device the buffers of its
  own experts, from every device of its ep group; the outputs return by the reverse all-to-all.
  Each device sends and receives about capacity_factor · N·K/ep rows per device of the group.
- dropless (gathering_tokens): how many assignments each device sends each other one is known
  only at run time, and XLA:CPU has no ragged all-to-all to send exactly them, so each device
  gathers the tokens of its ep group (an all-gather over ep), runs its own experts on the
  assignments routed to them, and the outputs [N, K, D] go back summed (a reduce-scatter).

In both, a device's experts run whole (their weights gathered over the other axes, as fsdp
gathers a layer's), and the gradients take the transposed way."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
from jax.sharding import PartitionSpec as P

from meshtrain.parallel.rules import Rules, mesh_axes_for

Inputs = tuple[jax.Array, jax.Array, dict[str, jax.Array], dict[str, jax.Array], jax.Array | None]
"""A layer's inputs to its experts: flat [N, D], experts [N, K], the expert weights (and
adapters) [E, ...], the adapters' inputs [N, D] and down's adapter dropout mask [N·K, F] or
None (models.moe.MoeFeedForward.adapter_inputs)."""


@dataclass(frozen=True)
class Exchange:
    """The all-to-all over the ep axes `axes` between a device's buffers for every expert and
    its own experts' buffers from every device of its ep group."""

    axes: tuple[str, ...]

    def to_experts(self, buffer: jax.Array) -> jax.Array:
        """[E, X, i] → [E/ep, ep·X, i]: rows for this device's experts, by sending device."""
        return jax.lax.all_to_all(buffer, self.axes, 0, 1, tiled=True)

    def back(self, buffer: jax.Array) -> jax.Array:
        """[E/ep, ep·X, o] → [E, X, o]: every expert's outputs for this device's rows."""
        return jax.lax.all_to_all(buffer, self.axes, 1, 0, tiled=True)


def exchanging_buffers(
    run: Callable[..., tuple[jax.Array, jax.Array]],
    axes: tuple[str, ...],
    rules: Rules,
    inputs: Inputs,
) -> tuple[jax.Array, jax.Array]:
    """`run` (MoeFeedForward.with_capacity) on each device's own tokens, its buffers exchanged
    over `axes` (ep) by `Exchange` → (outputs [N, K, D], the assignments dropped, int32 [])."""
    split = _split_axes(rules)

    def body(*inputs):
        outputs, dropped = run(*inputs, exchange=Exchange(axes))
        return outputs, jax.lax.psum(dropped, split)  # each token counted on its shard

    return _manual(body, axes, split, inputs, out_specs=(P(split), P()))


def gathering_tokens(
    run: Callable[..., jax.Array], axes: tuple[str, ...], rules: Rules, inputs: Inputs
) -> jax.Array:
    """`run` (MoeFeedForward.dropless_on) on the tokens of each device's ep group, gathered
    over `axes` (ep), for this device's experts, the outputs summed back over ep (each
    assignment is computed on one device, zeros elsewhere) → outputs [N, K, D]."""
    split = _split_axes(rules)

    def body(flat, experts, params, adapter_inputs, down_keep):
        gather = functools.partial(jax.lax.all_gather, axis_name=axes, axis=0, tiled=True)
        outputs = run(
            gather(flat),
            gather(experts),
            params,
            {k: gather(v) for k, v in adapter_inputs.items()},
            None if down_keep is None else gather(down_keep),
            first=jax.lax.axis_index(axes) * params["gate"].shape[0],
        )
        return jax.lax.psum_scatter(outputs, axes, scatter_dimension=0, tiled=True)

    return _manual(body, axes, split, inputs, out_specs=P(split))


def _manual(
    body: Callable, axes: tuple[str, ...], split: tuple[str, ...], inputs: Inputs, *, out_specs
):
    """body on each device's block of inputs, in a shard_map manual over every mesh axis: the
    token arrays split over `split`, the expert weights over `axes` only."""
    flat, experts, params, adapter_inputs, down_keep = inputs
    tokens = P(split)
    return jax.shard_map(
        body,
        in_specs=(
            tokens,
            tokens,
            {name: P(axes) for name in params},
            {k: tokens for k in adapter_inputs},
            None if down_keep is None else tokens,
        ),
        out_specs=out_specs,
        axis_names=set(jax.sharding.get_abstract_mesh().axis_names),
        check_vma=False,
    )(flat, experts, params, adapter_inputs, down_keep)


def _split_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes of size > 1 a layer's tokens are split over (ep among them)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in token_axes(rules) if mesh.shape[a] > 1)


def expert_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes of size > 1 the experts are split over in the current mesh (ep), or ()."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in mesh_axes_for("experts", rules) if mesh.shape.get(a, 1) > 1)


def token_shards(rules: Rules) -> int:
    """The devices a layer's tokens are split over in the current mesh (the expert-parallel
    paths run where they divide the tokens; a decode step of fewer rows runs as one program over
    them)."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in token_axes(rules))


def token_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes a layer's tokens [B·T, ...] are split over: the batch's, then the
    sequence's (cp)."""
    return (*mesh_axes_for("batch", rules), *mesh_axes_for("length", rules))
