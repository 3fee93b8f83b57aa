"""Synthetic dataset of uniformly random tokens, for benchmarks and shape tests."""

from __future__ import annotations

import numpy as np

SYNTHETIC_LENGTH = 1_000_000


class SyntheticDataset:
    """Random-access sequences of uniform tokens in [0, vocab_size); item i depends only on (seed, i)."""

    pad_id = -1  # no token is padding, so the loss mask keeps everything

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        seed: int,
        split: str,
        length: int = SYNTHETIC_LENGTH,
    ):
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.split = split
        self._seed = seed
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> np.ndarray:
        if not -self._length <= index < self._length:
            raise IndexError(f"index {index} out of range for {self._length} sequences")
        # Philox is a counter-based generator keyed by (seed, index): any item can be drawn
        # without generating the ones before it.
        key = np.array([self._seed, index % self._length], dtype=np.uint64)
        rng = np.random.Generator(np.random.Philox(key=key))
        tokens = rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int32)
        return tokens  # [seq_len + 1]
