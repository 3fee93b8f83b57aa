"""Capacity mode of a mixture of experts (models.moe): each expert takes at most C assignments of
each sequence, first come first served, into fixed buffers [E, S·C, ...]; the assignments past C
are dropped and counted. Which ones drop depends on the sequence alone, so the buffers can be
built where the tokens are and sent whole to the devices holding their experts (one all-to-all
over ep, models.expert_parallel) without changing the result.

Dimension letters: S sequences, T length, N tokens (S·T), K experts per token (top-k), M
assignments (N·K, token-major: token n's picks at n·K ... n·K + K - 1), E experts, C capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """C = ceil(capacity_factor · tokens · top_k / num_experts), at most `tokens` (a token picks
    an expert once, so no expert gets more): the assignments one expert takes in capacity mode.
    The product is rounded to 6 decimals first, so that 1.1 · 100 · 2 / 4 is 55, not 56."""
    return min(tokens, math.ceil(round(capacity_factor * tokens * top_k / num_experts, 6)))


@dataclass(frozen=True)
class CapacityRouting:
    """Where each assignment of S whole sequences goes: its expert and its slot in that expert's
    buffer of the sequence (`capacity` when it overflows: dropped)."""

    experts: jax.Array
    """[S, T·K] int32: each assignment's expert."""
    slots: jax.Array
    """[S, T·K] int32: its place among its expert's assignments of the sequence, in token
    order, or `capacity` (dropped)."""
    capacity: int
    num_experts: int

    @classmethod
    def of(cls, experts: jax.Array, *, length: int, capacity: int, num_experts: int):
        """experts [N, K] (whole sequences of `length` tokens) → their routing."""
        picks = experts.reshape(-1, length * experts.shape[-1])  # [S, T·K]
        arrivals = jnp.cumsum(jax.nn.one_hot(picks, num_experts, dtype=jnp.int32), axis=1)
        position = jnp.take_along_axis(arrivals, picks[..., None], axis=2)[..., 0] - 1
        slots = jnp.where(position < capacity, position, capacity)
        return cls(picks, slots, capacity, num_experts)

    @property
    def dropped(self) -> jax.Array:
        """int32 []: the assignments past their expert's capacity."""
        return jnp.sum(self.slots == self.capacity, dtype=jnp.int32)

    def dispatch(self, rows: jax.Array) -> jax.Array:
        """rows [M, i] (one per assignment, token-major) → buffer [E, S·C, i], sequence-major
        within each expert, zero where no assignment landed; the dropped ones are left out."""
        sequences, per_sequence = self.slots.shape
        width = rows.shape[-1]

        def one(experts: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
            buffer = jnp.zeros((self.num_experts, self.capacity, width), rows.dtype)
            return buffer.at[experts, slots].set(rows, mode="drop")  # [E, C, i]

        buffers = jax.vmap(one)(self.experts, self.slots, rows.reshape(sequences, per_sequence, -1))
        return buffers.swapaxes(0, 1).reshape(self.num_experts, -1, width)

    def combine(self, buffer: jax.Array) -> jax.Array:
        """buffer [E, S·C, o] (the experts' outputs, in dispatch's places) → [M, o], each
        assignment's output, zero for a dropped one."""
        sequences = self.slots.shape[0]
        buffers = buffer.reshape(self.num_experts, sequences, self.capacity, -1).swapaxes(0, 1)

        def one(experts: jax.Array, slots: jax.Array, buffer: jax.Array) -> jax.Array:
            return buffer.at[experts, slots].get(mode="fill", fill_value=0)  # [T·K, o]

        outputs = jax.vmap(one)(self.experts, self.slots, buffers)
        return outputs.reshape(-1, buffer.shape[-1])
