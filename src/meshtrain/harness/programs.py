"""The harness's scoring program, `score`: the log-probability of each target token of a packed
batch, and whether it is the model's most likely one (generation runs inference.decoding's
programs, through `inference.decoding.Decoding`).

It takes the model as a pytree (nnx.jit, graph=False, as inference.decoding): its arrays are
the model's own (no copy), so a training run evaluates its current parameters in place, and a
model rebuilt around other arrays of the same shapes reuses the compiled program.
It runs under the parameters' mesh (`jax.set_mesh`, by the caller), its inputs are global
arrays (`on_mesh`) and its outputs are replicated, so each process of a multi-process run holds
the whole result.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshtrain.models.interface import LanguageModel
from meshtrain.parallel.arrays import global_array
from meshtrain.parallel.rules import constrain, logical_to_spec

LOGITS_BUDGET = 1 << 26  # the most fp32 logits `score` holds at once (256 MiB)


def on_mesh(mesh: Mesh | None, array: np.ndarray, logical_axes: tuple, rules: Any) -> jax.Array:
    """`array`, the same on every process, as a global array on `mesh` laid out by its logical
    axes (each device reads its own slice), or as a local array without a mesh."""
    if mesh is None:
        return jnp.asarray(array)
    return global_array(array, NamedSharding(mesh, logical_to_spec(logical_axes, rules)))


def score_chunk(rows: int, vocab: int, length: int) -> int:
    """How many positions of a [rows, length] batch `score` turns into logits [rows, vocab] at
    a time: within LOGITS_BUDGET, at least 1."""
    return max(1, min(length, LOGITS_BUDGET // (rows * vocab)))


@partial(nnx.jit, static_argnames=("chunk",), graph=False)
def score(
    model: LanguageModel,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    targets: jax.Array,
    *,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """For a packed batch (int32 [R, L] each: harness.packing.PackedBatch), the log-probability
    of each target token under the model, float32 [R, L], and whether it is the argmax of the
    logits, bool [R, L]. The logits [R, V] of `chunk` positions at a time are computed from the
    hidden states and reduced at once (a batch's [R, L, V] logits can be gigabytes)."""
    hidden = model.hidden(tokens, positions, segment_ids)  # [R, L, D]
    weight, layout = model.output_weight()  # [V, D] or [D, V]

    def position(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        h, target = args  # [R, D], [R]
        logits = jnp.einsum(f"RD,{layout}->RV", h, weight).astype(jnp.float32)  # [R, V]
        picked = jnp.take_along_axis(logits, target[:, None], axis=-1)[:, 0]  # [R]
        logprob = picked - jax.nn.logsumexp(logits, axis=-1)
        return logprob, jnp.argmax(logits, axis=-1) == target

    per_position = (jnp.swapaxes(hidden, 0, 1), targets.T)  # [L, R, D], [L, R]
    logprob, greedy = jax.lax.map(position, per_position, batch_size=chunk)  # [L, R] each
    replicated = lambda x: constrain(x.T, (None, None), model.rules)  # noqa: E731
    return replicated(logprob), replicated(greedy)
