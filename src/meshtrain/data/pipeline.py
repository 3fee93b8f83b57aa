"""Datasets of packed token sequences and the deterministic, resumable batch iterator over them."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

from meshtrain.config import DataConfig
from meshtrain.config.schema import cache_dir
from meshtrain.data.corpus_cache import tokenised_corpus
from meshtrain.data.mixture import InOrder, Mixture, Order, shuffled_order
from meshtrain.data.packing import PackedDocuments
from meshtrain.data.shards import MANIFEST, PreparedCorpus
from meshtrain.data.sources import list_documents, resolve_paths, resolve_root
from meshtrain.data.synthetic import SyntheticDataset
from meshtrain.data.tokenizer import Tokenizer, build_tokenizer
from meshtrain.errors import DataError

log = logging.getLogger(__name__)

SPLITS = ("train", "validation")


class TokenDataset(Protocol):
    """Random-access sequences of seq_len + 1 tokens."""

    vocab_size: int  # tokenizer vocabulary incl. specials; synthetic: the model's vocab_size
    pad_id: int  # excluded from the loss; synthetic: -1, nothing is padded
    seq_len: int
    split: str  # "train" or "validation", named in errors

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> np.ndarray: ...  # int32 [seq_len + 1]


class MixedDataset:
    """The sources of data.mixture as one dataset: index i of source s is offsets[s] + i. Its
    `order` samples the sources by weight (meshtrain.data.mixture.Mixture)."""

    def __init__(
        self, names: Sequence[str], sources: Sequence[TokenDataset], weights: Sequence[float]
    ):
        self.names, self.sources, self.weights = list(names), list(sources), list(weights)
        first = sources[0]
        self.vocab_size, self.pad_id, self.seq_len = first.vocab_size, first.pad_id, first.seq_len
        self.split = first.split
        self._offsets = np.concatenate([[0], np.cumsum([len(s) for s in sources])])

    @property
    def parts(self) -> list[tuple[str, TokenDataset, float]]:
        """(name, dataset, weight) of each source."""
        return list(zip(self.names, self.sources, self.weights, strict=True))

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        source = int(np.searchsorted(self._offsets, index, side="right")) - 1
        return self.sources[source][index - int(self._offsets[source])]

    def mixture(self, seed: int | None) -> Mixture:
        """The weighted sampling of the sources; each shuffled anew per epoch from `seed`, or
        read in order (None: validation)."""
        orders = [
            InOrder(len(s)) if seed is None else shuffled_order(len(s), seed, i)
            for i, s in enumerate(self.sources)
        ]
        return Mixture(orders, self.weights, seed=0 if seed is None else seed)

    def order(self, seed: int | None) -> Order:
        return _MixedOrder(self.mixture(seed), self._offsets)


class _MixedOrder:
    """Stream positions → MixedDataset indices."""

    def __init__(self, mixture: Mixture, offsets: np.ndarray):
        self._mixture, self._offsets = mixture, offsets

    def __getitem__(self, position: int) -> int:
        source, index = self._mixture.locate(position)
        return int(self._offsets[source]) + index


def sequence_order(dataset: TokenDataset, seed: int | None) -> Order:
    """Stream positions → dataset indices: shuffled anew every epoch from `seed` (training), or
    in order, wrapping around (None: validation); a mixture samples its sources by weight."""
    if isinstance(dataset, MixedDataset):
        return dataset.order(seed)
    return InOrder(len(dataset)) if seed is None else shuffled_order(len(dataset), seed)


def source_shares(dataset: TokenDataset, seed: int, positions: int) -> dict[str, float]:
    """Each mixture source's share of the first `positions` training sequences ({} without a
    mixture); every sequence holds seq_len tokens, so these are shares of the tokens too."""
    if not isinstance(dataset, MixedDataset) or positions == 0:
        return {}
    counts = dataset.mixture(seed).positions_per_source(positions)
    return {name: float(c) / positions for name, c in zip(dataset.names, counts, strict=True)}


def _is_prepared(pattern: str) -> bool:
    return (Path(pattern).expanduser() / MANIFEST).is_file()


def _corpora(patterns: Sequence[str], cfg: DataConfig, *, key: str) -> list[PreparedCorpus]:
    """The prepared corpora of `patterns`: prepared directories opened as they are (their
    tokenizer checked), the other files, directories and globs tokenised (or read from the
    data cache) as one corpus."""
    corpora, others = [], []
    for pattern in patterns:
        if _is_prepared(pattern):
            corpus = PreparedCorpus(Path(pattern).expanduser())
            corpus.check_tokenizer(cfg.tokenizer)
            corpora.append(corpus)
        else:
            others.append(pattern)
    if others:
        files, root = resolve_paths(others, key=key)
        corpora.append(_tokenised(files, root, cfg))
    return corpora


def _tokenised(files: Sequence[Path], root: Path, cfg: DataConfig) -> PreparedCorpus:
    corpus = tokenised_corpus(
        files,
        root,
        tokenizer=cfg.tokenizer,
        text_key=cfg.text_key,
        on_bad_record=cfg.on_bad_record,
        directory=cache_dir(cfg.cache_dir, "data"),
    )
    if corpus.bad_records.total:
        log.info("data: %s (data.on_bad_record=skip)", corpus.bad_records.describe())
    return corpus


def _source_corpora(cfg: DataConfig) -> list[tuple[str, list[PreparedCorpus], float]]:
    """(name, corpora, weight) of every source of the run."""
    if cfg.mixture:
        return [
            (s.name, _corpora(s.paths, cfg, key=f"data.mixture[{i}].paths"), s.weight)
            for i, s in enumerate(cfg.mixture)
        ]
    if cfg.source == "prepared":
        return [("prepared", _corpora([cfg.path], cfg, key="data.path"), 1.0)]
    if cfg.paths:
        return [("text", _corpora(cfg.paths, cfg, key="data.paths"), 1.0)]
    files = list_documents(cfg.path, cfg.glob)
    return [("text", [_tokenised(files, resolve_root(cfg.path), cfg)], 1.0)]


def _packed(
    parts: Sequence[tuple[PreparedCorpus, np.ndarray]],
    cfg: DataConfig,
    tokenizer: Tokenizer,
    split: str,
) -> PackedDocuments:
    return PackedDocuments(
        parts,
        seq_len=cfg.seq_len,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        vocab_size=tokenizer.vocab_size,
        split=split,
    )


def _split_documents(
    corpora: Sequence[PreparedCorpus], fraction: float, split: str
) -> list[tuple[PreparedCorpus, np.ndarray]]:
    """Each corpus's documents of `split`: validation holds those whose stable draw (a hash of
    the document's file and record) is below `fraction`, the same on every machine and seed."""
    held_out = [c.draws < fraction for c in corpora]
    return [
        (c, np.flatnonzero(h if split == "validation" else ~h))
        for c, h in zip(corpora, held_out, strict=True)
    ]


def build_datasets(
    cfg: DataConfig, *, splits: Sequence[str], vocab_size: int
) -> dict[str, TokenDataset]:
    """The `splits` ("train", "validation") of the dataset described by `cfg`, all from one
    opening of its sources (one directory walk, one cache lookup, one index in memory).

    `vocab_size` is the model's embedding rows: synthetic tokens are drawn below it, and a
    tokenizer must fit in it. A split without documents is returned empty; the caller decides.
    """
    for split in splits:
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not supported; use one of {SPLITS}")
    if cfg.source == "synthetic":
        # Different Philox keys per split, so validation tokens are not training tokens.
        return {
            split: SyntheticDataset(
                vocab_size=vocab_size, seq_len=cfg.seq_len, seed=SPLITS.index(split), split=split
            )
            for split in splits
        }
    tokenizer = build_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"model.vocab_size={vocab_size} is smaller than the vocabulary of "
            f"data.tokenizer={cfg.tokenizer!r} ({tokenizer.vocab_size}); raise model.vocab_size"
        )
    datasets: dict[str, TokenDataset] = {}
    if "validation" in splits and cfg.validation_paths:
        corpora = _corpora(cfg.validation_paths, cfg, key="data.validation_paths")
        parts = [(c, np.arange(c.num_documents)) for c in corpora]
        datasets["validation"] = _packed(parts, cfg, tokenizer, "validation")
    rest = [split for split in splits if split not in datasets]
    if rest:
        sources = _source_corpora(cfg)
        fraction = 0.0 if cfg.validation_paths else cfg.validation_fraction
        for split in rest:
            datasets[split] = _split_dataset(sources, fraction, cfg, tokenizer, split)
    return {split: datasets[split] for split in splits}


def build_dataset(cfg: DataConfig, *, split: str, vocab_size: int) -> TokenDataset:
    """The `split` ("train" or "validation") of the dataset described by `cfg` (build_datasets)."""
    return build_datasets(cfg, splits=(split,), vocab_size=vocab_size)[split]


def _split_dataset(
    sources: Sequence[tuple[str, list[PreparedCorpus], float]],
    fraction: float,
    cfg: DataConfig,
    tokenizer: Tokenizer,
    split: str,
) -> TokenDataset:
    """One split of the sources: a single source's packed documents, or their mixture."""
    packed_sources = []
    for name, corpora, weight in sources:
        packed = _packed(_split_documents(corpora, fraction, split), cfg, tokenizer, split)
        if split == "train" and packed.num_documents == 0:
            raise DataError(f"data source {name!r} has no training documents{_emptied(corpora)}")
        packed_sources.append((name, packed, weight))
    if len(packed_sources) == 1:
        return packed_sources[0][1]
    if split == "validation":  # a source without held-out documents is left out of validation
        packed_sources = [s for s in packed_sources if len(s[1])] or packed_sources[:1]
    names, datasets, weights = zip(*packed_sources, strict=True)
    return MixedDataset(names, datasets, weights)


def _emptied(corpora: Sequence[PreparedCorpus]) -> str:
    skipped = [c.bad_records.describe() for c in corpora if c.bad_records.total]
    if skipped:
        return f": every document was skipped ({'; '.join(skipped)})"
    return "; check its paths and data.validation_fraction"


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

    Step k takes positions k*global_batch ... (k+1)*global_batch - 1 of the training order
    (`sequence_order`: shuffled anew each epoch, or a weighted mixture), arranges them as
    [accum_steps, global_batch // accum_steps] and keeps `rows` of the second axis. So the
    global batch depends only on (dataset, seed, global_batch, k), never on accum_steps or how
    rows are split over processes: a run resumes on the same batches with any process count.

    `workers` threads read the next `workers` steps' rows while the current one trains; a
    step's batch depends on nothing but its index, so reading ahead changes no batch.
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
        workers: int = 0,
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
        self.seed = seed
        self.step = start_step
        self._order = sequence_order(dataset, seed)
        self._pool = ThreadPoolExecutor(workers, "meshtrain-data") if workers else None
        self._ahead: deque[tuple[int, Future[np.ndarray]]] = deque()
        self._workers = workers

    def __iter__(self) -> BatchIterator:
        return self

    def read(self, k: int) -> np.ndarray:
        """Step k's rows: int32 [accum_steps, rows, seq_len + 1]."""
        positions = np.arange(k * self.global_batch, (k + 1) * self.global_batch)
        positions = positions.reshape(self.accum_steps, -1)[:, self.rows]  # [accum, rows]
        batch = np.stack([self.dataset[self._order[int(p)]] for p in positions.ravel()])
        return batch.reshape(*positions.shape, -1)

    def __next__(self) -> np.ndarray:
        k = self.step
        if self._pool is None:
            batch = self.read(k)
        else:
            if not self._ahead or self._ahead[0][0] != k:
                self._ahead.clear()
            while len(self._ahead) <= self._workers:
                ahead = k + len(self._ahead)
                self._ahead.append((ahead, self._pool.submit(self.read, ahead)))
            batch = self._ahead.popleft()[1].result()
        self.step = k + 1
        return batch

    def get_state(self) -> dict:
        """Returns the position as JSON-serialisable state: the index of the next step."""
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        """Moves to the position saved by get_state; the next batch is that step's."""
        self.step = int(state["step"])
        self._ahead.clear()


def validation_batches(
    dataset: TokenDataset, *, global_batch: int, num_batches: int, rows: slice
) -> list[np.ndarray]:
    """Returns the fixed validation batches, each int32 [rows.stop - rows.start, seq_len + 1].

    Batch b holds positions b*global_batch ... of the validation order (`sequence_order` with
    no seed: in order, wrapping around a short split), so every evaluation sees the same tokens.
    """
    _require_nonempty(dataset)
    _check_rows(rows, global_batch)
    order = sequence_order(dataset, None)
    batches = []
    for b in range(num_batches):
        positions = np.arange(b * global_batch, (b + 1) * global_batch)[rows]
        batches.append(np.stack([dataset[order[int(p)]] for p in positions]))
    return batches
