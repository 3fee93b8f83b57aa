"""objective.reference=precomputed: the reference scores every row of the pairs once, before
training, and each row then carries its targets' reference log-probabilities after its tokens
(train.objectives.token_scores.with_reference_scores), so the step runs the policy alone.

The reference is the one objective.reference=initial reads in the step: the starting weights
(without LoRA; read for the pass, then dropped) or the LoRA base with the adapters off. Its
log-probabilities are computed on the run's mesh, a micro-batch of rows at a time (one compiled
program), and kept beside the tokenised data in its cache (data.cache_dir) as
`reference/<key>.npy`, fp32 [rows, seq_len]. The key hashes every token of the split's rows,
where the reference comes from (its files' sha256, or the seed of a random one), the model's
config (not how it is laid out over the devices: mesh, remat, scan, pipeline) and the compute
dtype, so a file is only ever read for the same rows and the same reference; anything else
scores again. A resumed run reads the file its first start wrote, or scores again if it was
deleted. With data.cache_dir=null the scores live in memory for the run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.config.caches import cache_dir
from meshtrain.data import MixedDataset, TokenDataset
from meshtrain.train.batch import process_rows, to_global_array
from meshtrain.train.objectives.token_scores import reference_row_log_probs, with_reference_scores
from meshtrain.train.setup import Setup
from meshtrain.train.state import TrainState
from meshtrain.weights.lora_base import starting_weights_identity

log = logging.getLogger(__name__)

FORMAT = 1  # part of the key; bump when what a file holds changes
_HASHED_ROWS = 4096  # rows hashed at a time
# Model keys that place the computation, not what it computes: a run on another mesh reads
# the same scores (equal to fp32 rounding, as its losses are).
LAYOUT = frozenset({"name", "mesh_shape", "logical_axis_rules", "remat", "scan_layers", "pipeline"})


class ReferenceScored:
    """A dataset of pairs whose row i is its tokens, then its targets' reference
    log-probabilities `scores[i]` (fp32 [seq_len], as int32 bits): int32 [2 · seq_len + 1]."""

    def __init__(self, dataset: TokenDataset, scores: np.ndarray) -> None:
        if scores.shape != (len(dataset), dataset.seq_len):
            raise ValueError(f"scores {scores.shape} for {len(dataset)} rows of {dataset.seq_len}")
        self.dataset, self.scores = dataset, scores
        self.vocab_size, self.pad_id = dataset.vocab_size, dataset.pad_id
        self.seq_len, self.split = dataset.seq_len, dataset.split

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:  # what else the dataset tells (num_documents...)
        if name == "dataset":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index: int) -> np.ndarray:
        return with_reference_scores(self.dataset[index], self.scores[index])


def score_datasets(setup: Setup, shardings: TrainState, reference: Callable[[], Any]) -> None:
    """Puts the reference's log-probabilities beside the rows of setup.train_data and
    setup.validation_data (ReferenceScored; a mixture's sources each), from the cache or
    computed now with the weights `reference()` gives: the LoRA base (read with the adapters
    off), else the starting weights."""
    scorer = _Scorer(setup, shardings, reference)
    for name in ("train_data", "validation_data"):
        dataset = getattr(setup, name)
        if isinstance(dataset, MixedDataset):
            sources = [scorer.scored(source) for source in dataset.sources]
            setattr(setup, name, MixedDataset(dataset.names, sources, dataset.weights))
        elif dataset is not None:
            setattr(setup, name, scorer.scored(dataset))


class _Scorer:
    """Scores datasets with the reference, which it reads (and compiles its program for) at
    the first dataset the cache lacks."""

    def __init__(self, setup: Setup, shardings: TrainState, reference: Callable[[], Any]) -> None:
        self.setup, self.shardings, self.reference = setup, shardings, reference
        self._weights: Any = None
        self._program: Callable[..., jax.Array] | None = None

    def scored(self, dataset: TokenDataset) -> ReferenceScored:
        path = _cache_path(self.setup, dataset)
        scores = _cached(path)
        if _on_every_process(scores is not None):
            log.info("reference: the %s split's scores from %s", dataset.split, path)
            return ReferenceScored(dataset, scores)
        start = time.perf_counter()
        if self._program is None:
            self._weights = self.reference()
            self._program = scoring_program(self.setup, self.shardings)
        scores = _score(self.setup, self._program, self._weights, dataset)
        where = _save(path, scores)
        log.info(
            "reference: scored the %d rows of the %s split in %.1f s%s",
            len(dataset),
            dataset.split,
            time.perf_counter() - start,
            f" → {where}" if where else "",
        )
        return ReferenceScored(dataset, scores)


def _cache_path(setup: Setup, dataset: TokenDataset) -> Path | None:
    data_cache = cache_dir(setup.cfg.data.cache_dir, "data")
    if data_cache is None:
        return None
    directory = data_cache / "reference"
    cfg = setup.cfg
    digest = hashlib.sha256()
    identity = {
        "format": FORMAT,
        "reference": starting_weights_identity(cfg),
        "model": {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in LAYOUT},
        "mixed_precision": cfg.training.mixed_precision,
        "rows": [len(dataset), dataset.seq_len],
    }
    digest.update(json.dumps(identity, sort_keys=True, default=str).encode())
    for start in range(0, len(dataset), _HASHED_ROWS):
        rows = [dataset[i] for i in range(start, min(start + _HASHED_ROWS, len(dataset)))]
        digest.update(np.ascontiguousarray(np.stack(rows), np.int32).tobytes())
    return directory / f"{digest.hexdigest()[:32]}.npy"


def _cached(path: Path | None) -> np.ndarray | None:
    if path is None or not path.is_file():
        return None
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:  # damaged: scored again, and replaced
        log.warning("reference: %s cannot be read (%s); scoring again", path, err)
        return None


def _on_every_process(found: bool) -> bool:
    """Whether every process found its scores: else all of them compute (a collective)."""
    if jax.process_count() == 1:
        return found
    return bool(np.all(multihost_utils.process_allgather(np.asarray(found))))


def scoring_program(setup: Setup, shardings: TrainState) -> Callable[..., jax.Array]:
    """The jitted (reference, rows [micro_global, seq_len + 1]) → fp32 [micro_global, seq_len],
    on every process: `reference` the LoRA base (its adapters off) or the starting weights (the
    dry run lowers and compiles it with abstract ones)."""
    inputs, model = setup.objective.inputs, setup.model

    def score(reference: Any, rows: jax.Array) -> jax.Array:
        adapters = None
        if model.lora:  # read with the adapters off, whatever their values: zeros here
            adapters = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), model.trainable_params)
        return reference_row_log_probs(inputs, model, adapters, reference, rows)

    weights = shardings.frozen if model.lora else shardings.params
    everywhere = NamedSharding(setup.mesh, PartitionSpec())
    return jax.jit(score, in_shardings=(weights, setup.rows_sharding), out_shardings=everywhere)


def _score(
    setup: Setup, program: Callable[..., jax.Array], reference: Any, dataset: Any
) -> np.ndarray:
    """fp32 [len(dataset), seq_len]: every row scored, a micro-batch at a time (the last one
    padded with copies of row 0, whose scores are dropped)."""
    batch, seq_len = setup.micro_global, dataset.seq_len
    shape = (batch, seq_len + 1)
    sharding = setup.rows_sharding
    mine = process_rows(sharding, shape, axis=0)
    scores = np.empty((len(dataset), seq_len), np.float32)
    for start in range(0, len(dataset), batch):
        indices = [i if i < len(dataset) else 0 for i in range(start, start + batch)]
        local = np.stack([dataset[i] for i in indices[mine]])
        out = program(reference, to_global_array(local, sharding, shape))
        stop = min(start + batch, len(dataset))
        scores[start:stop] = np.asarray(out)[: stop - start]
    return scores


def _save(path: Path | None, scores: np.ndarray) -> Path | None:
    """Writes `scores` to `path` (a temporary name renamed into place: a process sharing the
    cache never reads half a file) from process 0; None if not cached."""
    if path is None or jax.process_index() != 0:
        return None
    staging = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".npy", dir=path.parent)
        with os.fdopen(fd, "wb") as file:
            np.save(file, scores)
        os.replace(staging, path)
    except OSError as err:
        if staging is not None:
            with suppress(OSError):
                os.unlink(staging)
        log.warning("reference: could not cache the scores in %s: %s", path.parent, err)
        return None
    return path
