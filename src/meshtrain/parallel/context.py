"""Context parallelism: how each sequence is split over the mesh axes of the `length` logical
axis (by default `cp`), in a layout that gives every device the same causal attention work.

A sequence of T positions is cut into 2·s chunks of c = T / (2·s) positions, for s devices
along cp. Device i holds chunks i and 2·s - 1 - i: an early chunk, whose queries see few keys
under a causal mask, and a late one, whose queries see many. Causal attention then computes
c²(2·s - 1) + c(c + 1) (query, key) pairs on every device (visible_pairs), where a contiguous
split would give the last device about 2·s - 1 times the work of the first.

Arrays [B, T, ...] that the step computes with (tokens, targets, loss weights, positions,
segment ids, the residual stream) are kept in that order, the "context layout": along T,
device 0's two chunks, then device 1's, and so on, so a plain split of T over cp hands every
device its own. Everything a token does on its own (embeddings, MLP, norms, the loss) does not
see the order; RoPE reads each token's position from the positions array, carried in the same
layout; attention gathers the keys and values of the whole sequence, puts them back in order
and masks with the true positions (models.context_attention).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.errors import ConfigError
from meshtrain.parallel.rules import Rules, active_axes, constrain, mesh_axes_for

CONTEXT_AXIS = "cp"


@dataclass(frozen=True)
class ContextLayout:
    """The context layout of sequences of `length` positions over `shards` devices, along the
    mesh axes `axes` (see the module docstring)."""

    shards: int
    length: int
    axes: tuple[str, ...] = (CONTEXT_AXIS,)

    def __post_init__(self) -> None:
        check_context_length(self.length, self.shards)

    @property
    def chunk(self) -> int:
        """Positions per chunk: T / (2·shards)."""
        return self.length // (2 * self.shards)

    def chunks(self, shard: int) -> tuple[int, int]:
        """The chunks device `shard` holds, in its order: the early one, then the late one."""
        return shard, 2 * self.shards - 1 - shard

    @property
    def slots(self) -> list[int]:
        """The chunk stored at each of the 2·shards chunk slots of the layout."""
        return [chunk for shard in range(self.shards) for chunk in self.chunks(shard)]

    @property
    def order(self) -> np.ndarray:
        """int32 [T]: the position in the sequence of each element of the layout."""
        c = self.chunk
        return np.concatenate([np.arange(j * c, (j + 1) * c) for j in self.slots]).astype(np.int32)

    def to_layout(self, x: jax.Array, axis: int = 1) -> jax.Array:
        """x in sequence order along `axis` (of length T) → the context layout."""
        return self._reordered(x, self.slots, axis)

    def to_sequence(self, x: jax.Array, axis: int = 1) -> jax.Array:
        """x in the context layout along `axis` → sequence order (to_layout's inverse)."""
        slot_of = {chunk: slot for slot, chunk in enumerate(self.slots)}
        return self._reordered(x, [slot_of[j] for j in range(2 * self.shards)], axis)

    def _reordered(self, x: jax.Array, pieces: list[int], axis: int) -> jax.Array:
        c = self.chunk
        parts = [jax.lax.slice_in_dim(x, p * c, (p + 1) * c, axis=axis) for p in pieces]
        return jnp.concatenate(parts, axis=axis)

    def describe(self, gathered_bytes: int) -> str:
        """The start-up line; gathered_bytes: the keys and values each device gathers per layer."""
        last = 2 * self.shards - 1
        return (
            f"context parallel: each sequence of {self.length} tokens split over "
            f"{'×'.join(self.axes)}={self.shards}, in {2 * self.shards} chunks of {self.chunk} "
            f"(device i holds chunks i and {last}-i: even causal attention work); keys and "
            f"values all-gathered in every layer, {gathered_bytes / 2**20:.1f} MiB per device"
        )

    def visible_pairs(self, shard: int, window: int | None = None) -> int:
        """(query, key) pairs that causal attention (with a sliding `window`: keys s with
        t - window < s ≤ t) computes for the queries device `shard` holds: its attention work."""
        total = 0
        for chunk in self.chunks(shard):
            queries = np.arange(chunk * self.chunk, (chunk + 1) * self.chunk)
            seen = queries + 1 if window is None else np.minimum(queries + 1, window)
            total += int(seen.sum())
        return total


def check_context_length(length: int, shards: int) -> None:
    """The layout needs T divisible by 2·shards (two chunks per device)."""
    if shards > 1 and length % (2 * shards):
        multiple = 2 * shards
        fit = max(multiple, length // multiple * multiple)
        raise ConfigError(
            f"data.seq_len={length} does not split into 2×cp={multiple} equal chunks (context "
            f"parallelism gives each cp device an early and a late chunk); use a multiple of "
            f"{multiple}, e.g. data.seq_len={fit}"
        )


def sequence_axes(mesh_shape: Mapping[str, int], rules: Rules) -> tuple[str, ...]:
    """The mesh axes of size > 1 that split sequences (the `length` rule's: cp by default)."""
    return active_axes(mesh_axes_for("length", rules), mesh_shape)


def sequence_shards(mesh_shape: Mapping[str, int], rules: Rules) -> int:
    """Devices each sequence is split over: the product of sequence_axes' sizes (1: none)."""
    return math.prod(mesh_shape[a] for a in sequence_axes(mesh_shape, rules))


def context_layout(length: int, rules: Rules) -> ContextLayout | None:
    """The layout of sequences of `length` under the current mesh (jax.set_mesh), or None where
    sequences are not split (no cp axis of size > 1, outside a mesh), or where `length` does
    not split into 2·cp chunks (a model called on such a sequence runs it whole, leaving XLA to
    partition it; training refuses that length at start-up, config.validate)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    axes = sequence_axes(mesh.shape, rules)
    shards = sequence_shards(mesh.shape, rules)
    if shards == 1 or length % (2 * shards):
        return None
    return ContextLayout(shards, length, axes)


def split_sequences(rules: Rules, *arrays: jax.Array | None) -> tuple[jax.Array | None, ...]:
    """Arrays [B, T] (or None) in sequence order → in the context layout, split over cp
    (unchanged without context parallelism)."""
    present = [a for a in arrays if a is not None]
    layout = context_layout(present[0].shape[1], rules) if present else None
    if layout is None:
        return arrays
    order = jnp.asarray(layout.order)

    def split(a: jax.Array) -> jax.Array:
        # Whole along T first (the batch is), so that each device picks its own positions
        # locally: a gather of an array split along T would move it between devices.
        whole = constrain(a, ("batch", None), rules)
        return constrain(jnp.take(whole, order, axis=1), ("batch", "length"), rules)

    return tuple(None if a is None else split(a) for a in arrays)
