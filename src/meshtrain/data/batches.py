"""The deterministic, resumable batches of training and the fixed batches of validation."""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from meshtrain.data.mixture import MixtureHistory, Order
from meshtrain.data.pipeline import MixedDataset, TokenDataset, sequence_order

log = logging.getLogger(__name__)


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

    Step k takes the next global_batch positions of the training stream (`sequence_order`:
    shuffled anew each epoch, or a weighted mixture): positions P ... P + global_batch - 1,
    P = k * global_batch in a fresh run. It arranges them as [accum_steps, global_batch //
    accum_steps] and keeps `rows` of the second axis. So the global batch depends only on
    (dataset, seed, global_batch, k), never on accum_steps or how rows are split over
    processes: a run resumes on the same batches with any process count.

    The state (get_state) holds the next step, its stream position and, for a mixture, the
    MixtureHistory. A resume continues at that position whatever changed on purpose
    (checkpoint.allow_changes): another global batch takes the positions after the saved one,
    and other mixture weights start a new segment that continues each source where it stopped.

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
        self._base = (start_step, start_step * global_batch)  # a step and its first position
        mixed = isinstance(dataset, MixedDataset)
        self.history: MixtureHistory | None = dataset.history(seed) if mixed else None
        self._order = self._stream_order()
        self._pool = ThreadPoolExecutor(workers, "meshtrain-data") if workers else None
        self._ahead: deque[tuple[int, Future[np.ndarray]]] = deque()
        self._workers = workers

    def _stream_order(self) -> Order:
        if self.history is None:
            return sequence_order(self.dataset, self.seed)
        assert isinstance(self.dataset, MixedDataset)
        return self.dataset.order(self.seed, self.history.current)

    def position(self, step: int) -> int:
        """The stream position of step `step`'s first sequence (= sequences before it)."""
        base_step, base_position = self._base
        return base_position + (step - base_step) * self.global_batch

    def shares(self, step: int) -> dict[str, float]:
        """Each mixture source's share of the sequences of the steps before `step` ({} without
        a mixture): every sequence holds seq_len tokens, so these are shares of tokens too."""
        return {} if self.history is None else self.history.shares(self.position(step))

    def __iter__(self) -> BatchIterator:
        return self

    def read(self, k: int) -> np.ndarray:
        """Step k's rows: int32 [accum_steps, rows, seq_len + 1]."""
        first = self.position(k)
        positions = np.arange(first, first + self.global_batch)
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

    def get_state(self) -> dict[str, Any]:
        """The position as JSON-serialisable state: the next step, the stream position of its
        first sequence and, for a mixture, the history of its weights."""
        state: dict[str, Any] = {"step": self.step, "position": self.position(self.step)}
        if self.history is not None:
            state["mixture"] = self.history.to_state()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Moves to the position saved by get_state; the next batch is that step's. A state
        without a position (older checkpoints) is at step * global_batch."""
        self._ahead.clear()
        self.step = int(state["step"])
        position = int(state.get("position", self.step * self.global_batch))
        self._base = (self.step, position)
        if self.history is None:
            return
        assert isinstance(self.dataset, MixedDataset)
        saved = state.get("mixture")
        # An older checkpoint holds no history: it was drawn with this run's weights and seed.
        history = MixtureHistory.from_state(saved) if saved else self.dataset.history(self.seed)
        self.history = history.continued(self.dataset.weights_by_name(), self.seed, position)
        self._order = self._stream_order()
        segment = self.history.current
        if segment.start == position > 0:  # a new segment (kept ones start before position)
            log.info(
                "data.mixture: from sequence %s of the stream on, the sources are drawn with "
                "the weights %s, each continuing where it stopped (drawn so far: %s)",
                f"{position:,}",
                ", ".join(f"{name} {w:g}" for name, w in segment.weights.items()),
                ", ".join(f"{name} {c:,}" for name, c in segment.drawn.items()),
            )


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
