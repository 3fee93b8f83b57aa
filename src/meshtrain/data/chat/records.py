"""Chat and preference records as the token ids a prepared unit stores: each conversation
rendered and marked by meshtrain.data.chat.encoder (data.source=chat), or each pair by
meshtrain.data.chat.pairs (data.source=preference: chosen then rejected), its untrained tokens
carrying data.chat.marks' NOT_TRAINED bit (uint32 ids), so the trained tokens are stored with the
tokens and read with them.

`chat_options(data)` are what define those ids beyond the tokenizer: the kind of record, its
keys, train_on, the template file and its content hash. The plan of a prepared directory and the
data cache's key hold them, so another template or train_on makes other files, never stale ones.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from meshtrain.data.chat.encoder import ChatEncoder, build_chat_encoder, load_chat_template
from meshtrain.data.chat.marks import NOT_TRAINED
from meshtrain.data.chat.pairs import PairEncoder, PreferenceKeys

if TYPE_CHECKING:  # prepare's workers load no config package
    from meshtrain.config.schema import DataConfig

TRAIN_ON = ("assistant", "completion", "all")  # config.data.TrainOn, without the config
# The data.source values whose ids carry marks (prompts: the rows of sampled completions).
MARKED_SOURCES = ("chat", "preference", "prompts")
_ENCODERS: dict[str, ChatEncoder] = {}  # one per worker process and options


def chat_options(data: DataConfig) -> dict[str, Any] | None:
    """The options that define chat or preference data's ids (None for other data); a missing
    or broken template is a one-line DataError here, before anything is read."""
    if data.source == "preference":
        return preference_options_for(
            data.tokenizer,
            chat_template=data.chat_template,
            prompt_key=data.prompt_key,
            chosen_key=data.chosen_key,
            rejected_key=data.rejected_key,
            shared_prompt=data.shared_prompt,
        )
    if data.source != "chat":
        return None
    return chat_options_for(
        data.tokenizer,
        chat_template=data.chat_template,
        train_on=data.train_on,
        messages_key=data.messages_key,
        prompt_key=data.prompt_key,
        completion_key=data.completion_key,
    )


def chat_options_for(
    tokenizer: str,
    *,
    chat_template: str | None,
    train_on: str | None,
    messages_key: str,
    prompt_key: str,
    completion_key: str,
) -> dict[str, Any]:
    """chat_options of these values (the prepare command's)."""
    return {
        "messages_key": messages_key,
        "prompt_key": prompt_key,
        "completion_key": completion_key,
        "train_on": train_on,
        **_template_options(tokenizer, chat_template),
    }


def preference_options_for(
    tokenizer: str,
    *,
    chat_template: str | None,
    prompt_key: str,
    chosen_key: str,
    rejected_key: str,
    shared_prompt: bool,
) -> dict[str, Any]:
    """The options of preference data (data.source=preference)."""
    return {
        "kind": "preference",
        "prompt_key": prompt_key,
        "chosen_key": chosen_key,
        "rejected_key": rejected_key,
        "shared_prompt": shared_prompt,
        **_template_options(tokenizer, chat_template),
    }


def _template_options(tokenizer: str, chat_template: str | None) -> dict[str, Any]:
    """The chat template's part of the options: the file given (if any) and the sha256 of the
    template's text (a missing or broken template: a one-line DataError)."""
    template = load_chat_template(tokenizer, chat_template)
    return {
        "chat_template": chat_template,
        "template_sha256": hashlib.sha256(template.text.encode()).hexdigest(),
    }


def is_preference(options: dict[str, Any] | None) -> bool:
    return options is not None and options.get("kind") == "preference"


def record_keys(options: dict[str, Any]) -> tuple[str, ...]:
    """The record fields (parquet columns) chat or preference data reads."""
    if is_preference(options):
        return options["prompt_key"], options["chosen_key"], options["rejected_key"]
    return options["messages_key"], options["prompt_key"], options["completion_key"]


def flagged_ids(tokenizer: str, options: dict[str, Any]) -> Callable[[dict], np.ndarray]:
    """record → uint32 [n]: its rendered token ids, NOT_TRAINED set on the tokens not trained
    (a preference record: its pair, meshtrain.data.chat.pairs). Raises the encoder's one-line
    DataError for a record it cannot use."""
    key = json.dumps([tokenizer, options], sort_keys=True)
    if is_preference(options):
        if key not in _ENCODERS:
            _ENCODERS[key] = build_chat_encoder(tokenizer, options["chat_template"])
        keys = PreferenceKeys(*record_keys(options))
        pairs, shared = PairEncoder(_ENCODERS[key], keys), options["shared_prompt"]
        return lambda record: pairs.encode(record).flagged(shared_prompt=shared)
    if key not in _ENCODERS:
        _ENCODERS[key] = build_chat_encoder(
            tokenizer,
            options["chat_template"],
            train_on=options["train_on"],
            messages_key=options["messages_key"],
            prompt_key=options["prompt_key"],
            completion_key=options["completion_key"],
        )
    encoder = _ENCODERS[key]

    def convert(record: dict) -> np.ndarray:
        encoded = encoder.encode(record)
        marks = np.where(encoded.trained, 0, NOT_TRAINED).astype(np.uint32)
        return encoded.ids.astype(np.uint32) | marks

    return convert
