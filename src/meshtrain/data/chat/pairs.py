"""Preference records → a pair of token sequences, chosen then rejected, as trl's DPOTrainer
tokenizes them, marked for the loss (data.source=preference; docs/preference.md).

A record is written as trl's preference datasets are:

- explicit prompt: `prompt`, `chosen` and `rejected` (data.prompt_key, data.chosen_key,
  data.rejected_key), three strings, or three lists of messages {role, content};
- implicit prompt: `chosen` and `rejected` only, two conversations that share their first turns
  (the shared turns are the prompt, as trl's `extract_prompt` takes them).

Conversations are rendered with the tokenizer's chat template (meshtrain.data.chat.template, as
transformers' apply_chat_template renders them): the prompt with the template's generation
prompt, then the prompt with each answer. Plain strings are tokenized as text, with the
tokenizer's specials, each answer ending in eos. Either way, as trl does, each sequence is the
tokenized prompt + answer, and its answer starts where it and the tokenized prompt alone first
differ (the same point for both answers: the shorter of the two common prefixes), so the prompt
tokens of the two sequences are the same. The answer tokens carry the loss, the prompt's carry
data.chat.marks' NOT_TRAINED.

The pair is stored as one unit, in one of two layouts (data.shared_prompt):

- shared (the default): the prompt once, then two branches (data.chat.marks' BRANCH_START on the
  first token of each), the chosen answer's and the rejected one's, each opening with the
  prompt's last token (whose output predicts the answer's first). The step reads each branch as
  seeing the prompt and itself, not the other, at the positions it has after the prompt
  (meshtrain.train.documents), so each answer's log-probabilities are those of prompt + answer,
  and the prompt's tokens are computed once: a pair takes its prompt's length fewer tokens.
- not shared: the chosen sequence, then the rejected one, whose first token carries
  DOCUMENT_START: two documents, as trl's DPOTrainer feeds them.

Packing keeps a unit whole in one sequence (meshtrain.data.chat.packing), so the two answers of
a pair are always in one micro-batch and on one device, and the objective
(meshtrain.train.objectives.preference) finds each pair from the document and branch starts.

Errors are one-line DataErrors without a file or line, which the caller prefixes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshtrain.data.chat.encoder import ChatEncoder, checked_messages
from meshtrain.data.chat.marks import BRANCH_START, DOCUMENT_START, NOT_TRAINED
from meshtrain.errors import DataError


@dataclass(frozen=True)
class PreferenceKeys:
    """The record fields of a pair (data.prompt_key, data.chosen_key, data.rejected_key)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"


@dataclass(frozen=True)
class EncodedPair:
    chosen: np.ndarray  # int32 [n]: prompt + chosen answer
    rejected: np.ndarray  # int32 [m]: prompt + rejected answer
    prompt_length: int  # tokens of the shared prompt at the start of both

    def flagged(self, *, shared_prompt: bool) -> np.ndarray:
        """uint32 [tokens]: the unit a prepared corpus stores, in the layout of `shared_prompt`
        (see the module docstring)."""
        if not shared_prompt:
            ids = np.concatenate([self.chosen, self.rejected]).astype(np.uint32)
            positions = np.concatenate([np.arange(len(self.chosen)), np.arange(len(self.rejected))])
            ids[positions < self.prompt_length] |= NOT_TRAINED
            ids[len(self.chosen)] |= DOCUMENT_START
            return ids
        start = max(self.prompt_length - 1, 0)  # the prompt's last token opens each branch
        branches = [self.chosen[start:], self.rejected[start:]]
        ids = np.concatenate([self.chosen[:start], *branches]).astype(np.uint32)
        positions = np.concatenate(
            [np.arange(start), *(start + np.arange(len(b)) for b in branches)]
        )
        ids[positions < self.prompt_length] |= NOT_TRAINED
        ids[[start, start + len(branches[0])]] |= BRANCH_START
        return ids


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def split_implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen answer, rejected answer) of two conversations (or strings) that share their
    start, as trl's extract_prompt splits them: the longest shared prefix is the prompt (for
    strings, ending before a space the two share)."""
    at = common_prefix_length(chosen, rejected)
    if isinstance(chosen, str) and at > 0 and chosen[at - 1] == " ":
        at -= 1
    return chosen[:at], chosen[at:], rejected[at:]


class PairEncoder:
    """Encodes preference records with a chat encoder's tokenizer and template."""

    def __init__(self, chat: ChatEncoder, keys: PreferenceKeys = PreferenceKeys()) -> None:
        self.chat, self.keys = chat, keys

    def encode(self, record: Mapping[str, Any]) -> EncodedPair:
        keys = self.keys
        if not isinstance(record, Mapping):
            raise DataError(f"a preference record is an object, not a {type(record).__name__}")
        missing = [k for k in (keys.chosen, keys.rejected) if k not in record]
        if missing:
            found = ", ".join(map(repr, record)) or "none"
            raise DataError(
                f"a preference record needs {keys.chosen!r} and {keys.rejected!r} (and "
                f"{keys.prompt!r}, or conversations that share their first turns); this one has "
                f"no {missing[0]!r} (its keys: {found})"
            )
        chosen, rejected = record[keys.chosen], record[keys.rejected]
        if keys.prompt in record:
            prompt = record[keys.prompt]
        elif isinstance(chosen, list) and isinstance(rejected, list):
            prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
            if not prompt:
                raise DataError(
                    f"{keys.chosen!r} and {keys.rejected!r} share no first turn to take as the "
                    f"prompt; give the prompt as {keys.prompt!r}"
                )
        else:
            raise DataError(
                f"a preference record without {keys.prompt!r} needs {keys.chosen!r} and "
                f"{keys.rejected!r} as conversations (lists of messages) that share their first "
                "turns"
            )
        if chosen == rejected:
            raise DataError(f"{keys.chosen!r} equals {keys.rejected!r}: the pair prefers nothing")
        if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
            return self._text(prompt, chosen, rejected)
        if all(isinstance(v, list | tuple) for v in (prompt, chosen, rejected)):
            return self._conversation(prompt, chosen, rejected)
        kinds = ", ".join(type(v).__name__ for v in (prompt, chosen, rejected))
        raise DataError(
            f"{keys.prompt!r}, {keys.chosen!r} and {keys.rejected!r} must be three strings or "
            f"three lists of messages, not {kinds}"
        )

    def _text(self, prompt: str, chosen: str, rejected: str) -> EncodedPair:
        """Plain text, as trl: each answer ends in eos, the texts tokenized with specials."""
        tokenizer = self.chat.tokenizer
        eos = self.chat.template.special_tokens.get("eos_token")

        def ids(text: str) -> np.ndarray:
            return tokenizer.encode_with_offsets(text, add_special_tokens=True)[0]

        def ended(answer: str) -> str:
            return answer if eos is None or answer.endswith(eos) else answer + eos

        full = [ids(prompt + ended(answer)) for answer in (chosen, rejected)]
        if eos is None:  # a tokenizer without an eos string: its id appended
            full = [np.append(f, np.int32(tokenizer.eos_id)) for f in full]
        return self._pair(ids(prompt), *full)

    def _conversation(
        self, prompt: Sequence[Any], chosen: Sequence[Any], rejected: Sequence[Any]
    ) -> EncodedPair:
        keys, chat = self.keys, self.chat
        prompt = checked_messages(prompt, keys.prompt)
        answers = [checked_messages(chosen, keys.chosen), checked_messages(rejected, keys.rejected)]

        def ids(messages: list[dict], generation_prompt: bool = False) -> np.ndarray:
            text = chat.render(messages, add_generation_prompt=generation_prompt)
            return chat.tokenizer.encode_with_offsets(text)[0]

        return self._pair(ids(prompt, True), *(ids(prompt + answer) for answer in answers))

    def _pair(self, prompt: np.ndarray, chosen: np.ndarray, rejected: np.ndarray) -> EncodedPair:
        shared = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
        keys = self.keys
        for name, ids in ((keys.chosen, chosen), (keys.rejected, rejected)):
            if len(ids) <= shared:
                raise DataError(f"{name!r} is empty: the pair has no {name} answer to train on")
        return EncodedPair(
            np.asarray(chosen, np.int32), np.asarray(rejected, np.int32), prompt_length=shared
        )


def pair_bounds(unit: np.ndarray) -> tuple[int, int]:
    """(where the chosen part starts, where the rejected part starts) in a stored unit
    (EncodedPair.flagged): its two branch starts, or, not shared, 0 and its second document's
    start; the unit's length for a part a truncation left out."""
    starts = np.flatnonzero(unit & BRANCH_START)
    if not len(starts):
        starts = np.concatenate([[0], np.flatnonzero(unit[1:] & DOCUMENT_START) + 1])
    chosen, rejected = [*starts[:2].tolist(), len(unit), len(unit)][:2]
    return chosen, rejected
