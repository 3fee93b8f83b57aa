"""Datasets of packed token sequences and the deterministic, resumable batch iterator over them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from meshtrain.config import DataConfig
from meshtrain.config.caches import cache_dir
from meshtrain.data.chat.packing import PackedConversations
from meshtrain.data.chat.records import MARKED_SOURCES, chat_options
from meshtrain.data.corpus_cache import tokenised_corpus
from meshtrain.data.mixture import (
    InOrder,
    Mixture,
    MixtureHistory,
    MixtureSegment,
    Order,
    shuffled_order,
)
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

    def weights_by_name(self) -> dict[str, float]:
        return dict(zip(self.names, self.weights, strict=True))

    def history(self, seed: int) -> MixtureHistory:
        """A fresh training stream's history: one segment, these weights, from position 0."""
        return MixtureHistory.fresh(self.weights_by_name(), seed)

    def mixture(self, seed: int | None, segment: MixtureSegment | None = None) -> Mixture:
        """The weighted sampling of the sources; each shuffled anew per epoch from `seed`, or
        read in order (None: validation). `segment` continues a stream at its start, each
        source from the sequences it had supplied (MixtureHistory); None: a fresh stream."""
        orders = [
            InOrder(len(s)) if seed is None else shuffled_order(len(s), seed, i)
            for i, s in enumerate(self.sources)
        ]
        if segment is None:
            return Mixture(orders, self.weights, seed=0 if seed is None else seed)
        return segment.mixture(orders)

    def order(self, seed: int | None, segment: MixtureSegment | None = None) -> Order:
        return _MixedOrder(self.mixture(seed, segment), self._offsets)


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


def _is_prepared(pattern: str) -> bool:
    return (Path(pattern).expanduser() / MANIFEST).is_file()


def _corpora(patterns: Sequence[str], cfg: DataConfig, *, key: str) -> list[PreparedCorpus]:
    """The prepared corpora of `patterns`: prepared directories opened as they are (their
    tokenizer checked), the other files, directories and globs tokenised (or read from the
    data cache) as one corpus."""
    corpora, others = [], []
    for pattern in patterns:
        if _is_prepared(pattern):
            corpus = PreparedCorpus(Path(pattern).expanduser(), verify=cfg.verify)
            corpus.check_tokenizer(cfg.tokenizer)
            _check_kind(corpus, cfg, key)
            corpora.append(corpus)
        else:
            others.append(pattern)
    if others:
        files, root = resolve_paths(others, key=key, records_only=cfg.source in MARKED_SOURCES)
        corpora.append(_tokenised(files, root, cfg))
    return corpora


def _check_kind(corpus: PreparedCorpus, cfg: DataConfig, key: str) -> None:
    """A prepared directory of conversations serves data=chat only, and only with the options
    it was prepared with; one of documents serves the others."""
    made, wanted = corpus.manifest.get("chat"), chat_options(cfg)
    if made == wanted:
        return
    if made is None or wanted is None:
        kind, other = ("documents", "data=chat") if made is None else ("conversations", "data=text")
        raise DataError(
            f"{key}: {corpus.directory} holds prepared {kind}, which {other} cannot train on; "
            f"prepare {'with' if made is None else 'without'} --chat into another --out"
        )
    changed = sorted(k for k in wanted if made.get(k) != wanted[k])
    raise DataError(
        f"{key}: {corpus.directory} was prepared with other chat options ({', '.join(changed)}: "
        f"{', '.join(f'{made.get(k)!r}' for k in changed)}); set them as it was prepared, or "
        "prepare again into another --out"
    )


def _tokenised(files: Sequence[Path], root: Path, cfg: DataConfig) -> PreparedCorpus:
    corpus = tokenised_corpus(
        files,
        root,
        tokenizer=cfg.tokenizer,
        text_key=cfg.text_key,
        on_bad_record=cfg.on_bad_record,
        directory=cache_dir(cfg.cache_dir, "data"),
        verify=cfg.verify,
        chat=chat_options(cfg),
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
        return [(cfg.source, _corpora(cfg.paths, cfg, key="data.paths"), 1.0)]
    files = list_documents(cfg.path, cfg.glob)
    return [("text", [_tokenised(files, resolve_root(cfg.path), cfg)], 1.0)]


def _packed(
    parts: Sequence[tuple[PreparedCorpus, np.ndarray]],
    cfg: DataConfig,
    tokenizer: Tokenizer,
    split: str,
) -> PackedDocuments | PackedConversations:
    if cfg.source in MARKED_SOURCES:
        packed = PackedConversations(
            parts,
            seq_len=cfg.seq_len,
            pad_id=max(tokenizer.pad_id, tokenizer.eos_id, 0),  # any id: padding is marked
            vocab_size=tokenizer.vocab_size,
            split=split,
            overlong=cfg.overlong,
            packing=cfg.packing,
            pairs=cfg.source == "preference",
        )
        if packed.overlong:
            done = "truncated to" if cfg.overlong == "truncate" else "left out: longer than"
            kind = "pairs" if packed.pairs else "conversations"
            lost = ""
            if packed.answers_lost:
                what = "an answer" if packed.pairs else "every answer token"
                lost = f"; {packed.answers_lost} of them lost {what} to the cut and train nothing"
            log.info(
                "data: %d of %d %s %s %s data.seq_len + 1 = %d tokens (data.overlong=%s)%s",
                packed.overlong,
                sum(len(docs) for _, docs in parts),
                split,
                kind,
                done,
                cfg.seq_len + 1,
                cfg.overlong,
                lost,
            )
        return packed
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
        for corpus in corpora:  # ids beyond the model's embedding: one line, not a NaN loss
            corpus.check_vocab(vocab_size)
        parts = [(c, np.arange(c.num_documents)) for c in corpora]
        datasets["validation"] = _packed(parts, cfg, tokenizer, "validation")
    rest = [split for split in splits if split not in datasets]
    if rest:
        sources = _source_corpora(cfg)
        for corpus in (c for _, corpora, _ in sources for c in corpora):
            corpus.check_vocab(vocab_size)
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
