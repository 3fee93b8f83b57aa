"""Token sequences of any length → batches of a few fixed shapes, for the harness's scoring.

Each sequence (a request's input tokens) is placed in a row of a batch [rows, length], next to
others in the same row (packing): its tokens carry positions 0 … n-1 and a segment id of their
own, so that the model's attention keeps them apart (models.attention: a query sees only keys of
its own segment) and each is scored as if it ran alone. `length` is a power of two, at least
MIN_LENGTH (the bucket of the longest sequence in the batch) and `rows` follows from it
(ROWS × length ≈ batch_tokens), so a whole evaluation compiles one program per bucket: at most
log2(max_length / MIN_LENGTH) + 1 of them, whatever the number and lengths of its requests.

Sequences are placed longest first, each in the first row with room for it (first fit
decreasing): a sequence that fits in no row opened so far opens a batch of its own bucket, and
shorter ones later fill the gaps left in the rows of earlier batches. All the batches are known
once every sequence is placed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_LENGTH = 32  # the shortest row: shorter sequences share rows of this length
PAD_SEGMENT = 0  # the segment id of padding; a sequence's are 1, 2, ... within its row


def bucket_length(length: int) -> int:
    """The row length of a batch whose longest sequence has `length` tokens: the next power of
    two, at least MIN_LENGTH."""
    return max(MIN_LENGTH, 1 << (max(length, 1) - 1).bit_length())


def rows_for(length: int, *, batch_tokens: int, row_multiple: int = 1) -> int:
    """The rows of a batch of `length`-token rows: batch_tokens // length (at least 1), rounded
    up to a multiple of `row_multiple` (the devices the batch is split over)."""
    rows = max(1, batch_tokens // length)
    return -(-rows // row_multiple) * row_multiple


@dataclass(frozen=True)
class Placement:
    """Where a sequence sits in its batch: row, first column, token count."""

    row: int
    start: int
    size: int


@dataclass
class PackedBatch:
    """One program's input, int32 [rows, length] each: tokens, their positions (0 … n-1 per
    sequence), segment ids (PAD_SEGMENT for padding) and the token each position predicts
    (`targets`: the sequence's next token; 0 under padding). `members` are the indices of the
    sequences it holds (in the caller's list) and `placements` where each sits."""

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    targets: np.ndarray
    members: list[int]
    placements: list[Placement]


def _new_batch(length: int, rows: int) -> PackedBatch:
    zeros = lambda: np.zeros((rows, length), np.int32)  # noqa: E731
    return PackedBatch(zeros(), zeros(), zeros(), zeros(), [], [])


def pack(
    inputs: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    *,
    max_length: int,
    batch_tokens: int,
    row_multiple: int = 1,
) -> list[PackedBatch]:
    """Packs each sequence inputs[i] (and the tokens it predicts, targets[i], of the same
    length, 1 … max_length tokens) into fixed-shape batches (see the module's docstring)."""
    sizes = np.asarray([len(s) for s in inputs], np.int64)
    if any(len(t) != n for t, n in zip(targets, sizes, strict=True)):
        raise ValueError("each sequence needs one target per input token")
    if sizes.size and (sizes.min() < 1 or sizes.max() > max_length):
        raise ValueError(f"sequences must hold 1 to max_length={max_length} tokens")
    batches: list[PackedBatch] = []
    # Every row opened so far, in order: its batch, its row there, its free tokens, its count of
    # sequences. Longest first, so a new batch's rows are never longer than the earlier ones.
    where = np.zeros((0, 2), np.int64)
    free = count = np.zeros(0, np.int64)
    for index in np.argsort(-sizes, kind="stable").tolist():
        size = int(sizes[index])
        room = np.flatnonzero(free >= size)
        if not room.size:  # a new batch of this sequence's bucket
            length = bucket_length(size)
            rows = rows_for(length, batch_tokens=batch_tokens, row_multiple=row_multiple)
            batches.append(_new_batch(length, rows))
            new = np.stack([np.full(rows, len(batches) - 1), np.arange(rows)], axis=1)
            where = np.concatenate([where, new])
            free = np.concatenate([free, np.full(rows, length)])
            count = np.concatenate([count, np.zeros(rows, np.int64)])
            room = np.asarray([free.size - rows])
        slot = int(room[0])
        batch, row = batches[where[slot, 0]], int(where[slot, 1])
        start = batch.tokens.shape[1] - int(free[slot])
        span = slice(start, start + size)
        batch.tokens[row, span] = inputs[index]
        batch.targets[row, span] = targets[index]
        batch.positions[row, span] = np.arange(size)
        count[slot] += 1
        batch.segment_ids[row, span] = count[slot]
        batch.members.append(index)
        batch.placements.append(Placement(row, start, size))
        free[slot] -= size
    return batches
