"""Expert parallelism: a mixture of experts' layer with its experts split over the ep mesh axis
(models.moe.MoeFeedForward), its tokens brought to the devices holding their experts and the
outputs brought back, in a shard_map manual over every mesh axis."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from meshtrain.parallel.rules import Rules, mesh_axes_for


def expert_parallel(
    run: Callable[..., tuple[jax.Array, jax.Array]],
    axes: tuple[str, ...],
    rules: Rules,
    flat: jax.Array,
    experts: jax.Array,
    params: dict[str, jax.Array],
    adapter_inputs: dict[str, jax.Array],
    down_keep: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """`run` (experts_on) with the experts split over the mesh axes `axes` (ep), in a
    shard_map manual over every axis: each device gathers the tokens of the devices that
    share its tokens' other shards but hold other experts (an all-gather over ep), runs
    its own E/ep experts on the picks routed to them, whole (their weights gathered over
    the other axes, as fsdp gathers a layer's), and the outputs go back to the devices
    that hold their tokens, summed (a reduce-scatter over ep: each pick was computed on
    one device, zeros elsewhere). The gradients take the transposed way."""
    mesh = jax.sharding.get_abstract_mesh()
    split = tuple(a for a in token_axes(rules) if mesh.shape[a] > 1)  # ep among them
    tokens = P(split)  # [N, ...] over the token shards; an expert weight over ep only

    def body(flat, experts, params, adapter_inputs, down_keep):
        gather = functools.partial(jax.lax.all_gather, axis_name=axes, axis=0, tiled=True)
        first = jax.lax.axis_index(axes) * params["gate"].shape[0]
        outputs, dropped = run(
            gather(flat),
            gather(experts),
            params,
            {k: gather(v) for k, v in adapter_inputs.items()},
            None if down_keep is None else gather(down_keep),
            first=first,
        )
        outputs = jax.lax.psum_scatter(outputs, axes, scatter_dimension=0, tiled=True)
        # each pick counted once: on its expert's device (not again on tp ranks)
        return outputs, jax.lax.psum(dropped, tuple(dict.fromkeys((*axes, *split))))

    return jax.shard_map(
        body,
        in_specs=(
            tokens,
            tokens,
            {name: P(axes) for name in params},
            {k: tokens for k in adapter_inputs},
            None if down_keep is None else tokens,
        ),
        out_specs=(tokens, P()),
        axis_names=set(mesh.axis_names),
        check_vma=False,
    )(flat, experts, params, adapter_inputs, down_keep)


def expert_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes of size > 1 the experts are split over in the current mesh (ep), or ()."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in mesh_axes_for("experts", rules) if mesh.shape.get(a, 1) > 1)


def token_shards(rules: Rules) -> int:
    """The devices a layer's tokens are split over in the current mesh (expert_parallel runs
    where they divide the tokens; a decode step of fewer rows runs as one program over them)."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in token_axes(rules))


def token_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes a layer's tokens [B·T, ...] are split over: the batch's, then the
    sequence's (cp)."""
    return (*mesh_axes_for("batch", rules), *mesh_axes_for("length", rules))
