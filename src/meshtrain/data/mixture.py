"""The order in which training sees sequences: one dataset shuffled anew each epoch, or several
sources sampled by weight (data.mixture). Both are random access: position p of the stream is
found without visiting the positions before it, so any step's batch can be read directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import grain
import numpy as np

MIXTURE_BLOCK = 10_000
"""Positions per mixing block: each block holds every source in its exact share (largest
remainder), in an order drawn from the seed, so shares never drift by more than one block."""


class Order(Protocol):
    def __getitem__(self, position: int) -> int: ...  # the dataset index at `position`


def _seed32(*entropy: int) -> int:
    """A 32-bit seed hashed from `entropy`: nearby seeds give unrelated streams."""
    return int(np.random.SeedSequence(list(entropy)).generate_state(1)[0])


def shuffled_order(length: int, *seed: int) -> Order:
    """Positions → indices of range(length), in a permutation drawn anew for every epoch from
    `seed` (one or more integers).

    grain's shuffle is random access (a keyed index permutation, nothing materialised) and,
    behind repeat(), reshuffles every epoch with seed + epoch. Because of that `+ epoch`, seeds
    s and s + 1 would see the same orders one epoch apart; hashing the seed to 32 bits first
    makes such overlaps between nearby seeds vanishingly unlikely.
    """
    return grain.MapDataset.range(length).shuffle(seed=_seed32(*seed)).repeat()


class InOrder:
    """Positions → indices of range(length) in order, wrapping around (validation)."""

    def __init__(self, length: int):
        self._length = length

    def __getitem__(self, position: int) -> int:
        return position % self._length


def block_counts(weights: Sequence[float], block: int = MIXTURE_BLOCK) -> np.ndarray:
    """int64 [sources]: positions of each source in a block, in proportion to `weights`
    (largest remainder, so they sum to `block`); every source gets at least one."""
    share = np.asarray(weights, np.float64) / float(np.sum(weights)) * block
    counts = np.floor(share).astype(np.int64)
    remainder = share - counts
    counts[np.argsort(-remainder, kind="stable")[: block - int(counts.sum())]] += 1
    if (counts == 0).any():
        small = int(np.flatnonzero(counts == 0)[0])
        raise ValueError(
            f"data.mixture[{small}].weight={weights[small]} is below 1/{block} of the total "
            "weight; raise it or drop that source"
        )
    return counts


class Mixture:
    """Positions → (source, index in that source) for sources sampled by weight.

    Position p lies in block p // MIXTURE_BLOCK, which holds block_counts positions of each
    source in an order drawn from (seed, block). The i-th position of source s in block b is
    that source's b * counts[s] + i-th sequence, taken from its own `orders[s]`, so every
    source is read through once per epoch of its own, however often it is drawn.
    """

    def __init__(self, orders: Sequence[Order], weights: Sequence[float], seed: int):
        self._orders = list(orders)
        self.counts = block_counts(weights)
        self._labels = np.repeat(np.arange(len(self.counts)), self.counts)  # [MIXTURE_BLOCK]
        self._seed = _seed32(seed, len(self.counts))
        # (block, source, rank) of the block read last, replaced as a whole: reader threads
        # may call locate concurrently.
        self._cached = (-1, self._labels, self._labels)

    def _sources(self, block: int) -> np.ndarray:
        """int64 [MIXTURE_BLOCK]: the source of each position of `block`."""
        rng = np.random.Generator(np.random.Philox(key=np.array([self._seed, block], np.uint64)))
        return rng.permutation(self._labels)

    def locate(self, position: int) -> tuple[int, int]:
        """(source, index in that source's dataset) of stream position `position`."""
        block, offset = divmod(position, MIXTURE_BLOCK)
        cached_block, source, rank = self._cached
        if cached_block != block:
            source = self._sources(block)
            by_source = np.argsort(source, kind="stable")
            first = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
            rank = np.empty(MIXTURE_BLOCK, np.int64)  # the position's rank within its source
            rank[by_source] = np.arange(MIXTURE_BLOCK) - first[source[by_source]]
            self._cached = (block, source, rank)
        drawn = block * int(self.counts[source[offset]]) + int(rank[offset])
        return int(source[offset]), int(self._orders[source[offset]][drawn])

    def positions_per_source(self, stop: int) -> np.ndarray:
        """int64 [sources]: how many of the positions [0, stop) each source supplied."""
        full, rest = divmod(stop, MIXTURE_BLOCK)
        counts = full * self.counts
        if rest:
            counts = counts + np.bincount(self._sources(full)[:rest], minlength=len(self.counts))
        return counts
