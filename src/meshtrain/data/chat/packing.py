"""Packs whole conversations (chat data) into fixed-length training sequences, read on demand.

Conversations are laid into windows of seq_len + 1 tokens whole, in data order, by
data.packing: `first_fit` puts each in the first of the OPEN_WINDOWS most recently opened windows
it fits (a window's conversations keep their data order; a short one can fill the gap another
left), `in_order` in the current window, or in a new one when it does not fit. The rest of a
window is padding. A conversation is never split across windows, so every sequence holds whole
turns and document masking (data.document_masking) keeps its attention inside each conversation.
Each token carries data.chat.marks' marks: NOT_TRAINED where it is no target of the loss (stored
with the tokens by meshtrain.data.chat.records; padding too), DOCUMENT_START on each
conversation's first.

A conversation longer than a window is cut to the window (data.overlong=truncate: its trained
tokens past the cut are lost), left out (drop) or a one-line error (error); the count is kept in
`overlong` for the log, and `answers_lost` counts the cut ones left with no trained token (or,
for a pair, an answer without one), which then teach nothing. Nothing is materialised: memory
holds a few arrays per conversation.

With `pairs` (preference data), each stored unit is a pair (meshtrain.data.chat.pairs: its prompt
and two answers), packed whole like a conversation; a pair longer than a window is truncated by
cutting the end of each answer, the longer one first, so that both keep their start (the prompt
and as much of each answer as fits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from meshtrain.data.chat.marks import DOCUMENT_START, NOT_TRAINED
from meshtrain.data.chat.pairs import pair_bounds
from meshtrain.errors import DataError

if TYPE_CHECKING:
    from meshtrain.data.shards import PreparedCorpus


OPEN_WINDOWS = 8  # first_fit: the most recently opened windows a conversation may join


def greedy_windows(lengths: np.ndarray, width: int) -> np.ndarray:
    """int64 [windows + 1]: the index of the first conversation of each window, then the count
    (data.packing=in_order). lengths: int64 [conversations], each 1..width."""
    firsts, fill = [0], 0
    for i, length in enumerate(lengths.tolist()):
        if fill + length > width:
            firsts.append(i)
            fill = 0
        fill += length
    firsts.append(len(lengths))
    return np.asarray(firsts if len(lengths) else [0], np.int64)


def first_fit_windows(lengths: np.ndarray, width: int) -> np.ndarray:
    """int64 [conversations]: the window of each conversation (data.packing=first_fit; windows
    numbered as they open). lengths: int64 [conversations], each 1..width."""
    window = np.empty(len(lengths), np.int64)
    open_windows: list[list[int]] = []  # [number, tokens filled], oldest first
    opened = 0
    for i, length in enumerate(lengths.tolist()):
        for slot in open_windows:
            if slot[1] + length <= width:
                slot[1] += length
                window[i] = slot[0]
                break
        else:
            if len(open_windows) == OPEN_WINDOWS:
                open_windows.pop(0)
            open_windows.append([opened, length])
            window[i] = opened
            opened += 1
    return window


def packed_windows(lengths: np.ndarray, width: int, packing: str) -> tuple[np.ndarray, np.ndarray]:
    """(order int64 [conversations]: the conversations window by window, each window's in data
    order; firsts int64 [windows + 1]: where each window starts in `order`, then the count)."""
    if packing == "in_order":
        return np.arange(len(lengths), dtype=np.int64), greedy_windows(lengths, width)
    window = first_fit_windows(lengths, width)
    order = np.argsort(window, kind="stable")
    windows = int(window.max()) + 1 if len(window) else 0
    return order, np.searchsorted(window[order], np.arange(windows + 1)).astype(np.int64)


class PackedConversations:
    """Random-access packed sequences (int32 [seq_len + 1], marked) of chosen conversations of
    prepared chat corpora, in the order given: corpus by corpus, in index order."""

    def __init__(
        self,
        parts: Sequence[tuple[PreparedCorpus, np.ndarray]],
        *,
        seq_len: int,
        pad_id: int,
        vocab_size: int,
        split: str,
        overlong: str,
        packing: str = "first_fit",
        pairs: bool = False,
    ):
        """parts: (corpus, int64 [n] indices of its conversations), in stream order."""
        self.seq_len, self.split, self.vocab_size = seq_len, split, vocab_size
        self.pairs = pairs
        self.pad_id = pad_id
        width = seq_len + 1
        self._corpora = [corpus for corpus, _ in parts]
        corpus = np.concatenate(
            [np.full(len(docs), i, np.int64) for i, (_, docs) in enumerate(parts)] or [[]]
        ).astype(np.int64)  # [n] which corpus each conversation is in
        document = np.concatenate([np.asarray(d, np.int64) for _, d in parts] or [[]])
        lengths = np.concatenate(
            [c.lengths[np.asarray(d, np.int64)] for c, d in parts] or [[]]
        ).astype(np.int64)
        longer = lengths > width
        self.overlong = int(longer.sum())  # conversations cut (truncate) or left out (drop)
        if self.overlong and overlong == "error":
            raise DataError(
                f"{self.overlong} {split} conversations are longer than data.seq_len + 1 = "
                f"{width} tokens (the longest: {int(lengths.max())}); raise data.seq_len, or set "
                "data.overlong=truncate or data.overlong=drop"
            )
        keep = ~longer if overlong == "drop" else np.ones(len(lengths), bool)
        self._corpus, self._document = corpus[keep], document[keep]
        self._full_lengths = lengths[keep]  # [n] the stored lengths, before any cut
        self._lengths = np.minimum(lengths[keep], width)  # [n] tokens taken of each
        self.answers_lost = 0  # truncated units left without a trained token (pairs: an answer)
        for c in np.flatnonzero(self._lengths < self._full_lengths):
            self.answers_lost += not _trains(self._unit(int(c)), pairs)
        # The conversations window by window, and where each window starts among them.
        self._order, self._firsts = packed_windows(self._lengths, width, packing)
        self.num_documents = len(self._lengths)
        self.num_tokens = int(self._lengths.sum())

    def __len__(self) -> int:
        return len(self._firsts) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} sequences")
        out = np.full(self.seq_len + 1, self.pad_id | NOT_TRAINED, np.int32)  # [seq_len + 1]
        at = 0
        for c in self._order[int(self._firsts[index]) : int(self._firsts[index + 1])].tolist():
            length = int(self._lengths[c])
            out[at : at + length] = self._unit(c)
            out[at] |= DOCUMENT_START
            at += length
        return out

    def _unit(self, c: int) -> np.ndarray:
        """int32 [tokens taken]: conversation (or pair) c as it is packed, cut if overlong."""
        length = int(self._lengths[c])
        corpus = self._corpora[int(self._corpus[c])]
        if self.pairs and length < self._full_lengths[c]:
            unit = corpus.read(int(self._document[c]), 0, int(self._full_lengths[c]))
            return truncated_pair(unit, length)
        return corpus.read(int(self._document[c]), 0, length)


def _trains(unit: np.ndarray, pairs: bool) -> bool:
    """Whether a packed unit still has a target of the loss: a token after its first without
    NOT_TRAINED (a pair: in each of its two answers)."""
    trained = (unit & NOT_TRAINED) == 0  # [tokens]
    trained[0] = False  # a unit's first token is predicted from nothing of it
    if not pairs:
        return bool(trained.any())
    chosen, rejected = pair_bounds(unit)
    return bool(trained[chosen:rejected].any() and trained[rejected + 1 :].any())


def truncated_pair(unit: np.ndarray, width: int) -> np.ndarray:
    """A stored pair cut to `width` tokens: the longer answer's end is cut first, then both
    evenly, each keeping its start (its branch or document start) after the prompt (shared)."""
    chosen, rejected = pair_bounds(unit)
    prompt, answers = unit[:chosen], (unit[chosen:rejected], unit[rejected:])
    room = width - len(prompt)
    if room <= 0:
        return unit[:width]  # the prompt alone fills the window: nothing left to train
    keep_chosen = min(len(answers[0]), max(room // 2, room - len(answers[1])))
    return np.concatenate([prompt, answers[0][:keep_chosen], answers[1][: room - keep_chosen]])
