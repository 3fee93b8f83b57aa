"""The model's side of the harness: packed batches scored and prompts continued, on the model's
mesh, by the programs of harness.programs.

Several processes: JAX runs a program only when every process calls it with the same inputs.
Process 0 runs lm-eval (it alone reads the tasks, builds the requests and computes the metrics)
and, before each program it runs, sends the command to the other processes (`Channel`: two
broadcasts over the devices, its size then its bytes); they wait in `follow()`, run each command
as it comes with the same inputs, and return when process 0 sends "stop" (`release()`, which
process 0 calls when it is done, also after an error, with a result for them). A generation's
loop runs on every process: the picked tokens are replicated, so each decides alike when to
stop.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshtrain.data.tokenizer import Tokenizer
from meshtrain.harness import programs
from meshtrain.harness.packing import PackedBatch
from meshtrain.inference.decoding import Decoding
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.rules import mesh_axes_for

BATCH_AXES = ("batch", None)  # logical axes of a packed batch [rows, length]


class Channel:
    """Process 0's commands to the other processes: any picklable value (processes of one job
    trust each other), broadcast over the devices."""

    def send(self, message: Any) -> None:
        data = np.frombuffer(pickle.dumps(message), np.uint8)
        multihost_utils.broadcast_one_to_all(np.int32(data.size))
        multihost_utils.broadcast_one_to_all(data)

    def receive(self) -> Any:
        size = int(multihost_utils.broadcast_one_to_all(np.int32(0)))
        data = multihost_utils.broadcast_one_to_all(np.zeros(size, np.uint8))
        return pickle.loads(np.asarray(data).tobytes())


# Decode steps between two checks of the rows' texts for their stop strings: a row runs at most
# this many steps past the token that completes its stop string.
STOP_CHECK_STEPS = 16


@dataclass(frozen=True)
class Generation:
    """One prompt to continue: its ids, the strings that end it, at most max_new_tokens new
    tokens; temperature 0 is greedy, above 0 samples with `seed`. Generations continued
    together share all but their ids."""

    ids: tuple[int, ...]
    until: tuple[str, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0


class Engine:
    """Runs the harness's programs for `model` (its parameters as they are: no copy) and
    `tokenizer`; scoring batches hold about `batch_tokens` tokens."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        batch_tokens: int = 4096,
        generate_batch: int = 16,
    ):
        self.model = model
        self.rules = model.rules
        self.mesh = model.params_mesh()
        self.vocab_rows = int(model.embed.shape[0])  # the logits' size, >= the tokenizer's
        self.tokenizer = tokenizer
        self.batch_tokens = batch_tokens
        axes = mesh_axes_for("batch", self.rules) if self.mesh is not None else ()
        # A packed batch's rows are split over the batch axes: a multiple of their devices.
        self.row_multiple = math.prod(self.mesh.shape[a] for a in axes) if axes else 1
        # Generations continued together: every batch has this many rows (padded with copies of
        # its first prompt), so one program serves each (prompt bucket, max_new_tokens).
        self.generate_rows = -(-generate_batch // self.row_multiple) * self.row_multiple
        self.channel = Channel() if jax.process_count() > 1 else None

    @property
    def is_driver(self) -> bool:
        """Whether this process runs the harness (process 0) rather than following it."""
        return jax.process_index() == 0

    def _put(self, array: np.ndarray | np.generic, axes: tuple = ()) -> jax.Array:
        return programs.on_mesh(self.mesh, np.asarray(array), axes, self.rules)

    def _command(self, name: str, argument: Any) -> None:
        if self.channel is not None:
            self.channel.send((name, argument))

    # The commands: process 0 calls them; on the others `follow` runs them.

    def score(self, batch: PackedBatch) -> tuple[np.ndarray, np.ndarray]:
        """The log-probability of each target token of `batch`, float32 [rows, length], and
        whether it is the model's most likely token, bool [rows, length]."""
        arrays = (batch.tokens, batch.positions, batch.segment_ids, batch.targets)
        self._command("score", arrays)
        return self._score(arrays)

    def generate(self, requests: list[Generation]) -> list[list[int]]:
        """The ids picked after each request's ids, continued together (at most generate_rows
        requests, alike but for their ids): up to max_new_tokens of them, ending before the
        tokenizer's eos, or with the token whose text completes one of the stop strings."""
        self._command("generate", requests)
        return self._generate(requests)

    def follow(self) -> Any:
        """On a process other than 0: run process 0's commands until it sends "stop"; returns
        what came with it."""
        run = {"score": self._score, "generate": self._generate}
        while (message := self.channel.receive())[0] != "stop":
            run[message[0]](message[1])
        return message[1]

    def release(self, result: Any = None) -> None:
        """On process 0, when done (or failed): the other processes leave `follow`, which
        returns `result` to them."""
        self._command("stop", result)

    # Their work, the same on every process.

    def _score(self, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        rows, length = arrays[0].shape
        with self.model.on_params_mesh():
            logprob, greedy = programs.score(
                self.model,
                *(self._put(a, BATCH_AXES) for a in arrays),
                chunk=programs.score_chunk(rows, self.vocab_rows, length),
            )
        return np.asarray(logprob), np.asarray(greedy)

    def _generate(self, requests: list[Generation]) -> list[list[int]]:
        first = requests[0]
        if len(requests) > self.generate_rows or any(
            (r.until, r.max_new_tokens, r.temperature, r.seed)
            != (first.until, first.max_new_tokens, first.temperature, first.seed)
            for r in requests
        ):
            raise ValueError(
                f"generations continued together are at most {self.generate_rows}, alike but "
                "for their ids"
            )
        prompts = [r.ids for r in requests] + [first.ids] * (self.generate_rows - len(requests))
        eos = self.tokenizer.eos_id
        new: list[list[int] | None] = [None] * len(requests)  # each row's ids once it ends
        with self.model.on_params_mesh():
            decoding = Decoding(
                self.model,
                prompts,
                first.max_new_tokens,
                first.temperature,
                stop_ids=(eos,),
                vocab_size=min(self.tokenizer.vocab_size, self.vocab_rows),
                seed=first.seed,
                put=self._put,
            )
            stopped = np.zeros(len(prompts), bool)
            stopped[len(requests) :] = True  # the padding rows: nothing to read
            checked = 0  # steps whose texts were checked
            while not stopped.all():
                picked = decoding.advance(STOP_CHECK_STEPS, stopped)
                for row in np.flatnonzero(~stopped):
                    ids = picked[row].tolist()
                    end = self._end(ids, checked, decoding.done[row], first.until)
                    if end is not None or decoding.finished:
                        new[row] = ids[:end]
                        stopped[row] = True
                checked = decoding.steps
        return new

    def _end(self, ids: list[int], checked: int, done: bool, until: tuple[str, ...]) -> int | None:
        """Where a row's ids end, if they have: before eos (a done row picked it), or with the
        first token from `checked` on whose text completes a stop string (as lm-eval's hf model
        stops: on the text, whatever tokens spell it)."""
        length = ids.index(self.tokenizer.eos_id) if done else len(ids)
        if self._ends(ids[:length], until):
            for end in range(max(checked, 1), length + 1):
                if self._ends(ids[:end], until):
                    return end
        return length if done else None

    def _ends(self, new: list[int], until: tuple[str, ...]) -> bool:
        """Whether the text of the new ids holds one of the stop strings (as lm-eval's hf
        model stops: on the text, whatever tokens spell it)."""
        text = self.tokenizer.decode(new)
        return any(stop and stop in text for stop in until)
