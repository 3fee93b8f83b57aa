"""The prompts a policy-gradient run samples from (data=prompts): every record of data.paths read
at start-up, its prompt encoded as generation starts from it, and the order in which the steps
take them.

A prompt is a string (tokenized with the tokenizer's special tokens, as trl tokenizes a plain
prompt; a completion stops at eos) or a list of messages (rendered with the chat template and
its generation prompt, as `data=chat` renders them; a completion stops at eos or the token that
closes the assistant's turn). The record's other columns travel with it to the reward functions.

Step k (from 0) takes the prompts at stream positions k·P … (k+1)·P − 1 (P prompts a step), the
stream being each epoch's own permutation of the records (training.seed and the epoch): a step's
prompts follow from the step alone, so a resumed run reads the same ones.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshtrain.data.bad_records import BadRecords
from meshtrain.data.chat.encoder import ChatEncoder, build_chat_encoder
from meshtrain.data.sources import document_format, read_records, resolve_paths
from meshtrain.data.tokenizer import Tokenizer
from meshtrain.errors import DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    ids: np.ndarray  # int32 [n]: what generation starts from
    stop_ids: tuple[int, ...]  # the ids that end a completion
    prompt: Any  # the record's prompt as written (a string or a list of messages)
    columns: dict[str, Any]  # the record's other columns

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)


class PromptSet:
    """The prompts of data.paths, in the order the steps take them (see the module docstring)."""

    def __init__(self, prompts: list[Prompt], *, per_step: int, seed: int) -> None:
        if not prompts:
            raise DataError("data.paths holds no prompt; add records with a prompt")
        self.prompts, self.per_step, self.seed = prompts, per_step, seed

    def __len__(self) -> int:
        return len(self.prompts)

    def for_step(self, k: int) -> list[Prompt]:
        """Iterator step k's prompts (k from 0)."""
        positions = range(k * self.per_step, (k + 1) * self.per_step)
        return [self.prompts[self._order(q // len(self))[q % len(self)]] for q in positions]

    @functools.lru_cache(maxsize=2)  # noqa: B019 (a run's one PromptSet: a step reads one or two epochs)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self))


def padded_width(*prompt_lists: list[Prompt]) -> int:
    """The width every prompt of a run is padded to: the longest, rounded up to a multiple of 8
    (one sampling program for the whole run)."""
    longest = max(p.ids.size for prompts in prompt_lists for p in prompts)
    return -(-longest // 8) * 8


def read_prompts(
    paths: list[str],
    *,
    tokenizer: str,
    chat_template: str | None,
    prompt_key: str,
    on_bad_record: str,
    key: str = "data.paths",
) -> tuple[list[Prompt], Tokenizer]:
    """Every prompt of the record files `paths` (the config's `key`), encoded (see the module
    docstring), and the tokenizer that encoded them; a record without `prompt_key` is a bad
    record (data.on_bad_record)."""
    files, _ = resolve_paths(paths, key=key, records_only=True)
    encoder = build_chat_encoder(tokenizer, chat_template)
    bad = BadRecords()
    prompts = []
    convert = _converter(encoder, prompt_key)
    for path in files:
        # Every column of a parquet file: the reward functions may read any of them.
        keys = _parquet_columns(path) if document_format(path) == "parquet" else ()
        records = read_records(path, convert, keys=keys, on_bad_record=on_bad_record, bad=bad)
        prompts.extend(prompt for _, prompt in records)
    if bad.total:
        log.warning("data: prompts: %s", bad.describe())
    return prompts, encoder.tokenizer


def _converter(encoder: ChatEncoder, prompt_key: str):
    eos = (int(encoder.tokenizer.eos_id),)

    def convert(record: dict[str, Any]) -> Prompt:
        if prompt_key not in record:
            raise DataError(f"no {prompt_key!r} (data.prompt_key) in the record")
        prompt = record[prompt_key]
        columns = {k: v for k, v in record.items() if k != prompt_key}
        if isinstance(prompt, str):
            ids = encoder.tokenizer.encode_with_offsets(prompt, add_special_tokens=True)[0]
            stop_ids = eos
        else:
            rendered = encoder.render_generation_prompt(prompt)
            ids, stop_ids = rendered.ids, tuple(int(i) for i in rendered.stop_ids)
        if not len(ids):
            raise DataError(f"{prompt_key!r} encodes to no token")
        return Prompt(np.asarray(ids, np.int32), stop_ids, prompt, columns)

    return convert


def _parquet_columns(path) -> list[str]:
    import pyarrow.parquet as pq  # here: prompts in jsonl never load it

    return pq.ParquetFile(path).schema_arrow.names
