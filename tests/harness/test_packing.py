"""Packing: every sequence lands whole in one row, with positions 0 … n-1 and a segment of its
own; batches come in a handful of shapes (one per power-of-two bucket), whatever the lengths."""

from __future__ import annotations

import numpy as np
import pytest

from meshtrain.harness.packing import MIN_LENGTH, bucket_length, pack, rows_for


def test_buckets_and_rows():
    assert [bucket_length(n) for n in (1, 32, 33, 100, 256, 257)] == [32, 32, 64, 128, 256, 512]
    assert MIN_LENGTH == 32
    assert rows_for(32, batch_tokens=4096) == 128
    assert rows_for(512, batch_tokens=4096, row_multiple=4) == 8
    assert rows_for(2048, batch_tokens=4096, row_multiple=4) == 4  # 2 rows, rounded up to 4
    assert rows_for(8192, batch_tokens=4096) == 1


def test_sequences_of_many_lengths_pack_into_few_shapes():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 257, 500)
    inputs = [rng.integers(3, 512, n).tolist() for n in lengths]
    targets = [rng.integers(3, 512, n).tolist() for n in lengths]
    batches = pack(inputs, targets, max_length=256, batch_tokens=1024, row_multiple=2)
    shapes = {b.tokens.shape for b in batches}
    assert shapes <= {(32, 32), (16, 64), (8, 128), (4, 256)}, shapes
    seen = []
    for batch in batches:
        for index, place in zip(batch.members, batch.placements, strict=True):
            span = slice(place.start, place.start + place.size)
            row = place.row
            assert place.size == lengths[index]
            assert batch.tokens[row, span].tolist() == inputs[index]
            assert batch.targets[row, span].tolist() == targets[index]
            assert batch.positions[row, span].tolist() == list(range(place.size))
            (segment,) = set(batch.segment_ids[row, span].tolist())
            assert segment > 0 and (batch.segment_ids[row] == segment).sum() == place.size
            seen.append(index)
        # padding: segment 0, nothing else there
        used = sum(p.size for p in batch.placements)
        assert (batch.segment_ids > 0).sum() == used
    assert sorted(seen) == list(range(500))
    # The rows are filled: shorter sequences fill the gaps the longer ones left (1.07 here).
    assert sum(b.tokens.size for b in batches) < 1.1 * lengths.sum()


def test_bad_sequences():
    with pytest.raises(ValueError, match="1 to max_length=8"):
        pack([[1] * 9], [[1] * 9], max_length=8, batch_tokens=64)
    with pytest.raises(ValueError, match="one target per input token"):
        pack([[1, 2]], [[1]], max_length=8, batch_tokens=64)
