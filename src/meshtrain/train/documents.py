"""Document masking: the segment ids and positions of packed sequences, read off the tokens.

Packing (meshtrain.data.packing) lays documents out as `[bos] doc [eos]` blocks in one stream
cut into sequences, so a document starts at each bos token, or, for a tokenizer without bos
(Qwen), right after each eos. The step derives each sequence's segments from its input tokens on
the device: the batch stays one int32 array, and no segment ids are stored or moved. A document
that continues from the previous sequence forms the first segment, with positions from 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from meshtrain.config.schema import DataConfig
from meshtrain.data.tokenizer import NO_TOKEN, build_tokenizer


@dataclass(frozen=True)
class DocumentBoundaries:
    """The special ids that mark where packed documents begin (data.document_masking)."""

    bos_id: int  # NO_TOKEN (-1): the tokenizer has none, documents start after each eos
    eos_id: int

    def segments(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(segment_ids, positions), int32 [B, T] each, of input tokens [B, T]: segments count
        the documents started so far in the row, positions restart at 0 with each document."""
        if self.bos_id != NO_TOKEN:
            starts = inputs == self.bos_id
        else:
            after_eos = inputs[:, :-1] == self.eos_id
            starts = jnp.pad(after_eos, ((0, 0), (1, 0)))
        segment_ids = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
        index = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # each token's document start
        return segment_ids, index - first


def document_boundaries(data: DataConfig) -> DocumentBoundaries | None:
    """The boundaries the step masks attention at: those of data.tokenizer, or None where
    data.document_masking is off or the data are random tokens (synthetic: no documents)."""
    if data.source == "synthetic" or not data.document_masking:
        return None
    tokenizer = build_tokenizer(data.tokenizer)
    return DocumentBoundaries(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
