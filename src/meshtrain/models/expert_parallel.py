"""A mixture of experts' layer (models.moe.MoeFeedForward) on a mesh whose devices hold
different tokens: in a shard_map manual over every mesh axis, each device runs the experts on
its own tokens, with its experts split over the ep mesh axes (expert parallelism) or, without
ep, every expert whole on every device (their weights gathered, as fsdp gathers a layer's), so
that nothing of the routing (the sort, the gathers, the buffers) is partitioned by XLA. With ep,
the tokens go to the devices holding their experts and the outputs come back, by the layer's
mode:

- capacity mode (exchanging_buffers): each device fills its tokens' buffers for every expert,
  [E, S·C, D] (models.capacity), and one all-to-all over ep sends each device the buffers of its
  own experts, from every device of its ep group; the outputs return by the reverse all-to-all.
  Each device sends and receives about capacity_factor · N·K rows in all, whatever ep is.
- dropless (gathering_tokens): how many assignments each device sends each other one is known
  only at run time, and XLA:CPU has no ragged all-to-all to send exactly them, so each device
  gathers the tokens of its ep group (an all-gather over ep), runs its own experts on the
  assignments routed to them, weights and sums each token's picks, and the sums go back added
  over ep (a reduce-scatter of [ep·N, D]).

Along tp (the mesh axes of the logical axis expert_mlp), each device holds its experts' slice of
the hidden width F, as the dense MLP's: gate and up [E, D, F/tp] and down [E, F/tp, D] (their
adapters' F sides too); the tp ranks of a group hold the same tokens, and the partial outputs of
down are summed over tp once per layer, after the picks' weighted sum. The gradients take the
transposed way."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
from jax.sharding import PartitionSpec as P

from meshtrain.models.routing import weighted_sum
from meshtrain.parallel.rules import Rules, active_axes, mesh_axes_for

Inputs = tuple[jax.Array, jax.Array, dict[str, jax.Array], dict[str, jax.Array], jax.Array | None]
"""A layer's inputs to its experts: flat [N, D], experts [N, K], the expert weights (and
adapters) [E, ...], the adapters' inputs [N, D] and down's adapter dropout mask [N·K, F] or
None (models.moe.MoeFeedForward.adapter_inputs)."""


HIDDEN_DIM = {"gate": 2, "up": 2, "down": 1, "gate_lora_b": 2, "up_lora_b": 2, "down_lora_a": 1}
"""Which dimension of each expert parameter (MoeFeedForward.expert_params) is an expert's hidden
width F: gate, up [E, D, F], down [E, F, D], gate's and up's B [E, r, F], down's A [E, F, r];
the others (the A of gate and up [E, D, r], down's B [E, r, D]) have none."""


@dataclass(frozen=True)
class Exchange:
    """The all-to-all over the ep axes `axes` between a device's buffers for every expert and
    its own experts' buffers from every device of its ep group; with no axes (every expert on
    every device), nothing moves."""

    axes: tuple[str, ...]

    def to_experts(self, buffer: jax.Array) -> jax.Array:
        """[E, X, i] → [E/ep, ep·X, i]: rows for this device's experts, by sending device."""
        return jax.lax.all_to_all(buffer, self.axes, 0, 1, tiled=True) if self.axes else buffer

    def back(self, buffer: jax.Array) -> jax.Array:
        """[E/ep, ep·X, o] → [E, X, o]: every expert's outputs for this device's rows."""
        return jax.lax.all_to_all(buffer, self.axes, 1, 0, tiled=True) if self.axes else buffer


NO_EXCHANGE = Exchange(())
"""Every expert on every device: the buffers stay where they are."""


def exchanging_buffers(
    run: Callable[..., tuple[jax.Array, jax.Array]],
    axes: tuple[str, ...],
    rules: Rules,
    inputs: Inputs,
    weights: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """`run` (MoeFeedForward.with_capacity) on each device's own tokens, its buffers exchanged
    over `axes` (ep) by `Exchange`, the outputs weighted by `weights` [N, K] and summed over
    the picks → ([N, D] fp32, the assignments dropped, int32 [])."""
    split, hidden = _split_axes(rules), _hidden_axes(rules)

    def body(weights, *inputs):
        outputs, dropped = run(*inputs, exchange=Exchange(axes))
        y = _sum_partials(weighted_sum(outputs, weights), hidden)
        return y, jax.lax.psum(dropped, split)  # each token's dropped picks counted on its shard

    return _manual(body, axes, split, hidden, weights, inputs, out_specs=(P(split), P()))


def gathering_tokens(
    run: Callable[..., jax.Array],
    axes: tuple[str, ...],
    rules: Rules,
    inputs: Inputs,
    weights: jax.Array,
) -> jax.Array:
    """`run` (MoeFeedForward.dropless_on) on the tokens of each device's ep group, gathered
    over `axes` (ep), for this device's experts; the outputs weighted by `weights` [N, K] and
    summed over the picks, then summed back over ep (each assignment is computed on one
    device, zeros elsewhere) → [N, D] fp32. With no `axes`, each device runs every expert on
    its own tokens."""
    split, hidden = _split_axes(rules), _hidden_axes(rules)

    def body(weights, flat, experts, params, adapter_inputs, down_keep):
        if not axes:
            y = weighted_sum(run(flat, experts, params, adapter_inputs, down_keep), weights)
            return _sum_partials(y, hidden)
        gather = functools.partial(jax.lax.all_gather, axis_name=axes, axis=0, tiled=True)
        outputs = run(
            gather(flat),
            gather(experts),
            params,
            {k: gather(v) for k, v in adapter_inputs.items()},
            None if down_keep is None else gather(down_keep),
            first=jax.lax.axis_index(axes) * params["gate"].shape[0],
        )
        partial = weighted_sum(outputs, gather(weights))  # [ep·N, D]: this device's picks
        y = jax.lax.psum_scatter(partial, axes, scatter_dimension=0, tiled=True)
        return _sum_partials(y, hidden)

    return _manual(body, axes, split, hidden, weights, inputs, out_specs=P(split))


def _manual(
    body: Callable,
    axes: tuple[str, ...],
    split: tuple[str, ...],
    hidden: tuple[str, ...],
    weights: jax.Array,
    inputs: Inputs,
    *,
    out_specs,
):
    """body(weights, *inputs) on each device's block of them, in a shard_map manual over every
    mesh axis: the token arrays split over `split` (the token axes), the expert weights over
    `axes` (ep) and along their hidden width F over `hidden` (tp), whole along the others."""
    flat, experts, params, adapter_inputs, down_keep = inputs
    tokens, hidden = P(split), hidden or None

    def expert_spec(name: str, ndim: int) -> P:
        f = HIDDEN_DIM.get(name)
        return P(axes, *[hidden if d == f else None for d in range(1, ndim)])

    return jax.shard_map(
        body,
        in_specs=(
            tokens,
            tokens,
            tokens,
            {name: expert_spec(name, value.ndim) for name, value in params.items()},
            {k: tokens for k in adapter_inputs},
            None if down_keep is None else P(*tokens, hidden),  # [N·K, F]
        ),
        out_specs=out_specs,
        axis_names=set(jax.sharding.get_abstract_mesh().axis_names),
        check_vma=False,
    )(weights, flat, experts, params, adapter_inputs, down_keep)


def _sum_partials(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """x summed over the mesh axes `axes` (the hidden axes: each device's partial output of
    down), or x itself without them."""
    return jax.lax.psum(x, axes) if axes else x


def _hidden_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes of size > 1 an expert's hidden width F is split over (tp)."""
    return active_axes(mesh_axes_for("expert_mlp", rules), jax.sharding.get_abstract_mesh().shape)


def _split_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes of size > 1 a layer's tokens are split over (ep among them)."""
    return active_axes(token_axes(rules), jax.sharding.get_abstract_mesh().shape)


def expert_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes of size > 1 the experts are split over in the current mesh (ep), or ()."""
    return active_axes(mesh_axes_for("experts", rules), jax.sharding.get_abstract_mesh().shape)


def token_shards(rules: Rules) -> int:
    """The devices a layer's tokens are split over in the current mesh, 1 without one (the
    per-device paths run where they divide the tokens; a decode step of fewer rows runs as one
    program over them)."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape.get(a, 1) for a in token_axes(rules))


def token_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes a layer's tokens [B·T, ...] are split over: the batch's, then the
    sequence's (cp)."""
    return (*mesh_axes_for("batch", rules), *mesh_axes_for("length", rules))
