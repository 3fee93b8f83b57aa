"""Datasets of packed token sequences and the deterministic, resumable batch iterator over them."""

from __future__ import annotations

from typing import Protocol

import grain
import numpy as np

from meshtrain.config import DataConfig
from meshtrain.config.schema import cache_dir
from meshtrain.data.corpus import list_documents, read_tokens, resolve_root, split_documents
from meshtrain.data.corpus_cache import cached_sequences
from meshtrain.data.packing import pack_documents
from meshtrain.data.synthetic import SyntheticDataset
from meshtrain.data.tokenizer import build_tokenizer

SPLITS = ("train", "validation")


class TokenDataset(Protocol):
    """Random-access sequences of seq_len + 1 tokens."""

    vocab_size: int  # tokenizer vocabulary incl. specials; synthetic: the model's vocab_size
    pad_id: int  # excluded from the loss; synthetic: -1, nothing is padded
    seq_len: int
    split: str  # "train" or "validation", named in errors

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> np.ndarray: ...  # int32 [seq_len + 1]


class PackedTextDataset:
    """Documents packed into sequences: in memory, or memory-mapped from the corpus cache
    (meshtrain.data.corpus_cache; read-only either way)."""

    def __init__(self, sequences: np.ndarray, *, vocab_size: int, pad_id: int, split: str):
        self.sequences = sequences  # int32 [num_sequences, seq_len + 1]
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.seq_len = sequences.shape[1] - 1
        self.split = split

    @property
    def num_tokens(self) -> int:
        """Tokens that are not padding, bos/eos included."""
        return int(np.count_nonzero(self.sequences != self.pad_id))

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.sequences[index]


def build_dataset(cfg: DataConfig, *, split: str, vocab_size: int) -> TokenDataset:
    """Returns the `split` ("train" or "validation") of the dataset described by `cfg`.

    `vocab_size` is the model's embedding rows: synthetic tokens are drawn below it, and a
    tokenizer must fit in it. A split without documents is returned empty; the caller decides.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not supported; use one of {SPLITS}")
    if cfg.source == "synthetic":
        # Different Philox keys per split, so validation tokens are not training tokens.
        return SyntheticDataset(
            vocab_size=vocab_size, seq_len=cfg.seq_len, seed=SPLITS.index(split), split=split
        )
    if cfg.source != "text_files":
        raise ValueError(
            f"data.source={cfg.source!r} is not supported; use text_files or synthetic"
        )
    tokenizer = build_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"model.vocab_size={vocab_size} is smaller than the vocabulary of "
            f"data.tokenizer={cfg.tokenizer!r} ({tokenizer.vocab_size}); raise model.vocab_size"
        )
    paths = list_documents(cfg.path, cfg.glob)
    train, validation = split_documents(paths, cfg.validation_fraction, root=resolve_root(cfg.path))
    documents = train if split == "train" else validation

    def pack() -> np.ndarray:
        return pack_documents(
            read_tokens(documents, tokenizer),
            cfg.seq_len,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
        )

    directory = cache_dir(cfg.cache_dir, "data")
    sequences = (
        pack()
        if directory is None
        else cached_sequences(directory, documents, tokenizer, cfg.seq_len, pack, split=split)
    )
    return PackedTextDataset(
        sequences, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, split=split
    )


def _require_nonempty(dataset: TokenDataset) -> None:
    if len(dataset) == 0:
        raise ValueError(
            f"the {dataset.split!r} split has no sequences; check data.path, data.glob and "
            "data.validation_fraction"
        )


def _check_rows(rows: slice, size: int) -> None:
    bounded = rows.start is not None and rows.stop is not None
    if rows.step not in (None, 1) or not bounded or not 0 <= rows.start < rows.stop <= size:
        raise ValueError(f"rows={rows} must be a contiguous, non-empty slice of range({size})")


class BatchIterator:
    """Yields int32 [accum_steps, rows.stop - rows.start, seq_len + 1] batches, forever.

    Step k takes positions k*global_batch ... (k+1)*global_batch - 1 of the stream of sequence
    indices shuffled anew each epoch, arranges them as [accum_steps, global_batch // accum_steps]
    and keeps `rows` of the second axis. So the global batch depends only on (dataset, seed,
    global_batch, k), never on accum_steps or how rows are split over processes.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        global_batch: int,
        accum_steps: int,
        rows: slice,
        seed: int,
        start_step: int = 0,
    ):
        _require_nonempty(dataset)
        if accum_steps < 1 or global_batch % accum_steps != 0:
            raise ValueError(
                f"global batch {global_batch} is not divisible by "
                f"training.gradient_accumulation_steps={accum_steps}"
            )
        _check_rows(rows, global_batch // accum_steps)
        self.dataset = dataset
        self.global_batch = global_batch
        self.accum_steps = accum_steps
        self.rows = rows
        self.step = start_step
        # grain's shuffle is random access (a keyed index permutation, nothing materialised) and,
        # behind repeat(), reshuffles every epoch with seed + epoch. Because of that `+ epoch`,
        # seeds s and s + 1 would see the same orders one epoch apart; hashing the seed to 32
        # bits first makes such overlaps between nearby seeds vanishingly unlikely.
        grain_seed = int(np.random.SeedSequence(seed).generate_state(1)[0])
        self._order = grain.MapDataset.range(len(dataset)).shuffle(seed=grain_seed).repeat()

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> np.ndarray:
        k = self.step
        positions = np.arange(k * self.global_batch, (k + 1) * self.global_batch)
        positions = positions.reshape(self.accum_steps, -1)[:, self.rows]  # [accum, rows]
        # Only this process's rows are looked up: ~5 µs each, so no epoch permutation is cached.
        batch = np.stack([self.dataset[self._order[int(p)]] for p in positions.ravel()])
        self.step = k + 1
        return batch.reshape(*positions.shape, -1)  # [accum, rows, seq_len + 1]

    def get_state(self) -> dict:
        """Returns the position as JSON-serialisable state: the index of the next step."""
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        """Moves to the position saved by get_state; the next batch is that step's."""
        self.step = int(state["step"])


def validation_batches(
    dataset: TokenDataset, *, global_batch: int, num_batches: int, rows: slice
) -> list[np.ndarray]:
    """Returns the fixed validation batches, each int32 [rows.stop - rows.start, seq_len + 1].

    Batch b holds sequences b*global_batch ... in order (wrapping around a short split), so every
    evaluation sees the same tokens.
    """
    _require_nonempty(dataset)
    _check_rows(rows, global_batch)
    batches = []
    for b in range(num_batches):
        indices = np.arange(b * global_batch, (b + 1) * global_batch)[rows] % len(dataset)
        batches.append(np.stack([dataset[int(i)] for i in indices]))
    return batches
