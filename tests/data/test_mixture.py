"""Sampling sources by weight (data.mixture): shares, determinism, random access, and each
source read through once per epoch of its own."""

import json

import numpy as np
import pytest

from meshtrain.data.mixture import (
    MIXTURE_BLOCK,
    InOrder,
    Mixture,
    MixtureHistory,
    block_counts,
    shuffled_order,
)
from meshtrain.data.pipeline import MixedDataset, sequence_order


class Constant:
    """A dataset whose every sequence is its source number: what a batch drew is visible."""

    def __init__(self, value, length, split="train"):
        self.value, self.length, self.split = value, length, split
        self.vocab_size, self.pad_id, self.seq_len = 10, 9, 3

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        assert 0 <= index < self.length
        return np.full(4, self.value, np.int32)


def test_block_counts_are_the_weights_shares():
    counts = block_counts([0.7, 0.2, 0.1])
    assert counts.tolist() == [7000, 2000, 1000] and counts.sum() == MIXTURE_BLOCK
    assert block_counts([1, 1, 1]).tolist() == [3334, 3333, 3333]
    with pytest.raises(ValueError, match=r"^data\.mixture\[1\]\.weight=1e-06 is below 1/10000"):
        block_counts([1.0, 1e-6])


@pytest.mark.parametrize("weights", [(0.7, 0.3), (5.0, 1.0, 2.0)])
def test_shares_within_tolerance_of_the_weights(weights):
    mixture = Mixture([shuffled_order(50, 0, i) for i in range(len(weights))], weights, seed=3)
    positions = 2_000  # a fifth of a block: the draw is random, not exact
    drawn = np.bincount([mixture.locate(p)[0] for p in range(positions)], minlength=len(weights))
    expected = np.asarray(weights) / sum(weights)
    # Drawn without replacement from the block's exact shares: within 4 standard deviations.
    sd = np.sqrt(expected * (1 - expected) / positions)
    assert np.all(np.abs(drawn / positions - expected) < 4 * sd), drawn
    np.testing.assert_array_equal(mixture.positions_per_source(positions), drawn)
    np.testing.assert_array_equal(
        mixture.positions_per_source(3 * MIXTURE_BLOCK), 3 * block_counts(weights)
    )


def test_each_source_is_read_through_once_per_epoch_and_positions_are_random_access():
    orders = [shuffled_order(40, 0, 0), shuffled_order(7, 0, 1)]
    mixture = Mixture(orders, [0.5, 0.5], seed=0)
    located = [mixture.locate(p) for p in range(600)]
    for source, size in ((0, 40), (1, 7)):
        drawn = [i for s, i in located if s == source]
        assert sorted(drawn[:size]) == list(range(size))  # one epoch: every sequence once
        assert sorted(drawn[size : 2 * size]) == list(range(size))
    # Any position, in any order, gives what the sequential walk gave; also across blocks.
    fresh = Mixture(orders, [0.5, 0.5], seed=0)
    for p in [599, 3, 12_345, 250, 10_001]:
        assert fresh.locate(p) == mixture.locate(p)


def test_the_seed_decides_the_order():
    def draws(seed):
        mixture = Mixture([InOrder(100), InOrder(100)], [1, 1], seed=seed)
        return [mixture.locate(p) for p in range(200)]

    assert draws(1) == draws(1) and draws(1) != draws(2)


@pytest.mark.slow
def test_mixed_dataset_batches_and_logged_shares():
    dataset = MixedDataset(["code", "prose"], [Constant(0, 30), Constant(1, 500)], [0.7, 0.3])
    order = sequence_order(dataset, seed=0)
    values = np.array([dataset[order[p]][0] for p in range(4_000)])
    shares = dataset.history(seed=0).shares(4_000)
    assert shares == {"code": np.mean(values == 0), "prose": np.mean(values == 1)}
    assert abs(shares["code"] - 0.7) < 0.03


def test_a_history_continues_each_source_where_it_stopped_and_counts_what_was_drawn():
    orders = [InOrder(100_000), InOrder(100_000)]
    history = MixtureHistory.fresh({"a": 0.9, "b": 0.1}, seed=0)
    first = history.current.mixture(orders)
    drawn = [first.locate(p) for p in range(10_500)]
    state = json.loads(json.dumps(history.continued({"a": 0.1, "b": 0.9}, 0, 10_500).to_state()))
    resumed = MixtureHistory.from_state(state)
    assert [s.start for s in resumed.segments] == [0, 10_500]
    before = np.bincount([s for s, _ in drawn], minlength=2)
    assert resumed.current.drawn == {"a": before[0], "b": before[1]}
    assert 9_000 < before[0] < 10_500  # a full block's 9,000, then about 90% of 500
    second = resumed.current.mixture(orders)
    drawn += [second.locate(p) for p in range(10_500, 13_500)]
    for source in (0, 1):  # in order, no sequence twice: each continues where it stopped
        indices = [i for s, i in drawn if s == source]
        assert indices == list(range(len(indices)))
    counted = np.bincount([s for s, _ in drawn], minlength=2)
    assert resumed.counts(13_500) == {"a": counted[0], "b": counted[1]}
    assert resumed.shares(13_500)["b"] == counted[1] / 13_500
    assert 2_500 < counted[1] - before[1] < 3_000  # about 90% of the 3,000 after the change
    # The same weights and seed continue the segment they are in; position 0 starts afresh.
    assert resumed.continued({"a": 0.1, "b": 0.9}, 0, 12_000).segments == resumed.segments
    assert len(resumed.continued({"a": 0.1, "b": 0.9}, 1, 12_000).segments) == 3
    assert resumed.continued({"a": 0.5}, 0, 0).to_state() == [
        {"start": 0, "seed": 0, "sources": [["a", 0.5, 0]]}
    ]
