"""How the step reads a batch of token ids [B, seq_len + 1]: inputs and targets, the targets
that carry loss, and, for document masking, each input's segment id and position.

Text: packing (meshtrain.data.packing) lays documents out as `[bos] doc [eos]` blocks in one
stream cut into sequences, so a document starts at each bos token, or, for a tokenizer without
bos (Qwen), right after each eos; every target but padding carries loss. Chat data
(data.source=chat): the ids carry marks in their high bits (meshtrain.data.chat.marks), which say
which targets are trained and where each packed conversation starts; with document masking no
target is trained across a conversation's start.

Either way the step derives this from the tokens on the device: the batch stays one int32
array, and no masks or segment ids are stored or moved. A document that continues from the
previous sequence forms the first segment, with positions from 0.

A chat document may have branches (marks.BRANCH_START: a preference pair stored as its prompt
once, then each answer, meshtrain.data.chat.pairs): each branch sees the document's tokens
before its first branch and itself (models.attention.same_document), and its positions continue
from that shared start, as if it followed it alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from meshtrain.config.schema import DataConfig
from meshtrain.data.chat.marks import BRANCH_START, DOCUMENT_START, ID_BITS, NOT_TRAINED
from meshtrain.data.chat.records import MARKED_SOURCES
from meshtrain.data.tokenizer import NO_TOKEN, build_tokenizer
from meshtrain.models.attention import with_branches


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
        return segments_from_starts(starts)


def segments_from_starts(starts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(segment_ids, positions), int32 [B, T] each, from bool [B, T]: where documents start."""
    segment_ids = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
    index = jnp.broadcast_to(jnp.arange(starts.shape[1], dtype=jnp.int32), starts.shape)
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # each token's document start
    return segment_ids, index - first


def branched_segments(starts: jax.Array, branch_starts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(segment_ids, positions), int32 [B, T] each, from bool [B, T]: where documents and where
    their branches start (see the module docstring). A segment id carries its token's branch
    (models.attention.with_branches); a branch's positions skip the earlier branches of its
    document."""
    segment_ids, positions = segments_from_starts(starts)
    index = jnp.broadcast_to(jnp.arange(starts.shape[1], dtype=jnp.int32), starts.shape)
    count = jnp.cumsum(branch_starts, axis=1, dtype=jnp.int32)  # branches started in the row
    before = jax.lax.cummax(jnp.where(starts, count - branch_starts, 0), axis=1)
    branch = count - before  # 0: the document's shared start, then 1, 2...
    latest = jax.lax.cummax(jnp.where(branch_starts, index, 0), axis=1)  # this branch's start
    first = jax.lax.cummax(jnp.where(branch_starts & (branch == 1), index, 0), axis=1)
    skipped = jnp.where(branch > 1, latest - first, 0)  # the tokens of the earlier branches
    return with_branches(segment_ids, branch), positions - skipped


@dataclass(frozen=True)
class TokenFormat:
    """How the step reads a batch: see the module docstring."""

    pad_id: int = NO_TOKEN  # text: targets equal to it carry no loss (NO_TOKEN: none)
    documents: DocumentBoundaries | None = None  # None: no document masking
    flagged: bool = False  # chat data: the ids carry meshtrain.data.chat.marks' marks

    def read(
        self, tokens: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
        """tokens [B, seq_len + 1] → inputs and targets int32 [B, T], the mask of targets that
        carry loss fp32 [B, T], and with document masking each input's segment id and position
        int32 [B, T] (else None)."""
        if not self.flagged:
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            mask = (targets != self.pad_id).astype(jnp.float32)
            if self.documents is None:
                return inputs, targets, mask, None, None
            return inputs, targets, mask, *self.documents.segments(inputs)
        ids = tokens & ID_BITS
        mask = ((tokens[:, 1:] & NOT_TRAINED) == 0).astype(jnp.float32)
        if self.documents is None:
            return ids[:, :-1], ids[:, 1:], mask, None, None
        starts = (tokens & DOCUMENT_START) != 0  # [B, seq_len + 1]
        # No target across a boundary: a conversation's first token is not predicted from the
        # one packed before it (data.train_on=all would train it), as trl's padding-free
        # collator masks it.
        mask = mask * (~starts[:, 1:]).astype(jnp.float32)
        branch_starts = (tokens[:, :-1] & BRANCH_START) != 0
        segments = branched_segments(starts[:, :-1], branch_starts)
        return ids[:, :-1], ids[:, 1:], mask, *segments


def document_boundaries(data: DataConfig) -> DocumentBoundaries | None:
    """The boundaries the step masks attention at: those of data.tokenizer, or None where
    data.document_masking is off or the data are random tokens (synthetic: no documents)."""
    if data.source == "synthetic" or not data.document_masking:
        return None
    tokenizer = build_tokenizer(data.tokenizer)
    return DocumentBoundaries(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)


def token_format(data: DataConfig, pad_id: int = NO_TOKEN) -> TokenFormat:
    """How the step reads batches of `data` (`pad_id`: the dataset's padding id)."""
    return TokenFormat(pad_id, document_boundaries(data), flagged=data.source in MARKED_SOURCES)
