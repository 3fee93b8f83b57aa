"""The order in which training sees sequences: one dataset shuffled anew each epoch, or several
sources sampled by weight (data.mixture). Both are random access: position p of the stream is
found without visiting the positions before it, so any step's batch can be read directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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

    Position p lies in block (p - start) // MIXTURE_BLOCK, which holds block_counts positions
    of each source in an order drawn from (seed, block). The i-th position of source s in block
    b is that source's drawn[s] + b * counts[s] + i-th sequence, taken from its own `orders[s]`,
    so every source is read through once per epoch of its own, however often it is drawn.
    `start` and `drawn` continue a stream whose earlier positions were drawn with other weights
    (MixtureHistory); a fresh stream starts at 0 with nothing drawn. Without `orders` a Mixture
    only counts (positions_per_source).
    """

    def __init__(
        self,
        orders: Sequence[Order] | None,
        weights: Sequence[float],
        seed: int,
        *,
        start: int = 0,
        drawn: Sequence[int] | None = None,
    ):
        self._orders = list(orders or ())
        self.counts = block_counts(weights)
        self.start = start
        self._drawn = np.zeros(len(self.counts), np.int64) if drawn is None else np.asarray(drawn)
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
        """(source, index in that source's dataset) of stream position `position` (>= start)."""
        block, offset = divmod(position - self.start, MIXTURE_BLOCK)
        cached_block, source, rank = self._cached
        if cached_block != block:
            source = self._sources(block)
            by_source = np.argsort(source, kind="stable")
            first = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
            rank = np.empty(MIXTURE_BLOCK, np.int64)  # the position's rank within its source
            rank[by_source] = np.arange(MIXTURE_BLOCK) - first[source[by_source]]
            self._cached = (block, source, rank)
        s = int(source[offset])
        drawn = int(self._drawn[s]) + block * int(self.counts[s]) + int(rank[offset])
        return s, int(self._orders[s][drawn])

    def positions_per_source(self, stop: int) -> np.ndarray:
        """int64 [sources]: how many of the positions [start, stop) each source supplied."""
        full, rest = divmod(max(stop - self.start, 0), MIXTURE_BLOCK)
        counts = full * self.counts
        if rest:
            counts = counts + np.bincount(self._sources(full)[:rest], minlength=len(self.counts))
        return counts


@dataclass(frozen=True)
class MixtureSegment:
    """A stretch of the training stream drawn with one set of weights: from stream position
    `start` until the next segment's start (or on)."""

    start: int
    seed: int
    weights: dict[str, float]  # source name → weight, in the mixture's order
    drawn: dict[str, int]  # sequences each source had supplied before `start`

    def mixture(self, orders: Sequence[Order] | None = None) -> Mixture:
        names = list(self.weights)
        return Mixture(
            orders,
            list(self.weights.values()),
            self.seed,
            start=self.start,
            drawn=[self.drawn.get(name, 0) for name in names],
        )

    def same_draw(self, other: MixtureSegment) -> bool:
        """Whether `other` continues this segment's draw (same sources, weights and seed)."""
        return (list(self.weights.items()), self.seed) == (list(other.weights.items()), other.seed)


class MixtureHistory:
    """The segments of a training stream, oldest first: the weights each stretch of positions
    was drawn with. Saved with every checkpoint (to_state), so a run resumed with changed
    weights (checkpoint.allow_changes) continues each source where it stopped, and the logged
    shares count what was actually drawn."""

    def __init__(self, segments: Sequence[MixtureSegment]):
        self.segments = list(segments)

    @classmethod
    def fresh(cls, weights: dict[str, float], seed: int) -> MixtureHistory:
        return cls([MixtureSegment(0, seed, dict(weights), dict.fromkeys(weights, 0))])

    @property
    def current(self) -> MixtureSegment:
        return self.segments[-1]

    def counts(self, position: int) -> dict[str, int]:
        """Sequences each source supplied to stream positions [0, position), by name."""
        totals: dict[str, int] = {}
        ends = [s.start for s in self.segments[1:]] + [position]
        for segment, end in zip(self.segments, ends, strict=True):
            drawn = segment.mixture().positions_per_source(min(end, position))
            for name, count in zip(segment.weights, drawn, strict=True):
                totals[name] = totals.get(name, 0) + int(count)
        return totals

    def shares(self, position: int) -> dict[str, float]:
        """Each source's share of stream positions [0, position) ({} at 0)."""
        if position == 0:
            return {}
        return {name: count / position for name, count in self.counts(position).items()}

    def continued(self, weights: dict[str, float], seed: int, position: int) -> MixtureHistory:
        """This history continued from stream `position` with `weights` and `seed`: the same
        history when they are the current segment's, else one with a new segment there."""
        if position == 0:
            return MixtureHistory.fresh(weights, seed)
        kept = [s for s in self.segments if s.start < position]  # the first starts at 0
        history = MixtureHistory(kept)
        counts = history.counts(position)
        drawn = {name: counts.get(name, 0) for name in weights}
        segment = MixtureSegment(position, seed, dict(weights), drawn)
        if history.current.same_draw(segment):
            return history
        return MixtureHistory([*kept, segment])

    def to_state(self) -> list[dict[str, Any]]:
        """JSON: per segment its start, seed and [name, weight, drawn] of each source, in the
        mixture's order (a list, so that no JSON writer can reorder the sources)."""
        return [
            {
                "start": s.start,
                "seed": s.seed,
                "sources": [[name, w, s.drawn[name]] for name, w in s.weights.items()],
            }
            for s in self.segments
        ]

    @classmethod
    def from_state(cls, state: Sequence[dict[str, Any]]) -> MixtureHistory:
        return cls(
            [
                MixtureSegment(
                    int(s["start"]),
                    int(s["seed"]),
                    {name: float(w) for name, w, _ in s["sources"]},
                    {name: int(d) for name, _, d in s["sources"]},
                )
                for s in state
            ]
        )
