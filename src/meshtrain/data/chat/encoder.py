"""Chat records → token ids and the tokens to train, rendered as transformers' apply_chat_template
renders them (meshtrain.data.chat.template: the same Jinja sandbox and helpers, the same template
file, the same special tokens) and tokenized as it tokenizes them (without added specials).

    encoder = build_chat_encoder(data.tokenizer, data.chat_template)  # None: the tokenizer's own
    encoded = encoder.encode(record)  # EncodedChat
    encoded.ids      # int32 [n]: the rendered conversation's tokens
    encoded.trained  # bool [n]: whether token i is a target of the loss
    encoder.render_generation_prompt(messages)  # GenerationPrompt(ids, stop_ids): for inference

ChatEncoder(tokenizer, template, train_on=None, messages_key="messages", prompt_key="prompt",
completion_key="completion", template_kwargs=None) also has encode_messages(messages, train_on=),
encode_prompt_completion(prompt, completion, train_on=), render(messages, add_generation_prompt=),
and generation_prompt, end_of_turn and stop_ids (found by rendering a probe conversation).

A record is `messages`, a list of {role, content} (roles system, user, assistant; content a
string; other keys go to the template as they are), or `prompt` and `completion`: two strings or
two lists of messages. `train_on` (default "assistant" for messages, "completion" for prompt and
completion) picks the trained tokens: "assistant" every assistant turn; "completion" the last
assistant turn of messages, the assistant turns of a conversational completion; "all" every token.
An assistant turn is what the model writes after the template's generation prompt (the role
header `<|im_start|>assistant\\n` is not trained, a `<think>` block the template writes there is),
through the token that closes the turn (`<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`: trained), not
the newline after it. Plain-string prompt and completion follow trl's SFTTrainer: not templated,
prompt + completion + eos tokenized with the tokenizer's specials (a bos where its tokenizer.json
prepends one), trained from the first token where that differs from the prompt's own tokens (with
train_on "assistant" too, as there are no turns).

How: the conversation is rendered and tokenized once, with character offsets. A turn starts where
the rendering of the messages before it plus the generation prompt ends, where that rendering is
how the conversation's starts; else (Qwen 3 writes earlier turns differently) after the next
generation-prompt header from the end of the turn before. It ends with the first end-of-turn
token after its content. A token is trained if it overlaps a trained turn's characters.

Errors are one-line DataErrors without a file or line, which the caller prefixes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from meshtrain.data.chat.template import ChatTemplate, load_chat_template
from meshtrain.data.tokenizer import HFTokenizer, build_tokenizer
from meshtrain.errors import ConfigError, DataError

__all__ = [
    "ChatEncoder",
    "ChatTemplate",
    "EncodedChat",
    "GenerationPrompt",
    "build_chat_encoder",
    "load_chat_template",
]
TrainOn = Literal["assistant", "completion", "all"]
TRAIN_ON = ("assistant", "completion", "all")
ROLES = ("system", "user", "assistant")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Probe reply."}]


@dataclass(frozen=True)
class EncodedChat:
    ids: np.ndarray  # int32 [n]
    trained: np.ndarray  # bool [n]: whether token i is a target of the loss


@dataclass(frozen=True)
class GenerationPrompt:
    ids: np.ndarray  # int32 [n]: the conversation and the template's generation prompt
    stop_ids: tuple[int, ...]  # eos and the token that closes an assistant turn


def checked_messages(value: Any, key: str) -> list[dict[str, Any]]:
    """`value` checked as a list of messages, as the template sees them: keys whose value is None
    dropped, the reasoning under each of its names (transformers' normalisation)."""
    if not isinstance(value, list | tuple) or not value:
        raise DataError(
            f"{key!r} must be a non-empty list of messages {{role, content}}, not {_describe(value)}"
        )
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise DataError(
                f"{key}[{i}] must be a message {{role, content}}, not {_describe(message)}"
            )
        if "role" not in message or "content" not in message:
            missing = "role" if "role" not in message else "content"
            raise DataError(f"{key}[{i}] has no {missing!r}; a message is {{role, content}}")
        if message["role"] not in ROLES:
            raise DataError(
                f"{key}[{i}] has role {message['role']!r}; the roles are {', '.join(ROLES)}"
            )
        if not isinstance(message["content"], str):
            raise DataError(
                f"{key}[{i}] has content of type {type(message['content']).__name__}; content must be a string"
            )
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


def _describe(value: Any) -> str:
    empty = isinstance(value, list | tuple) and not value
    return "an empty list" if empty else f"a {type(value).__name__}"


class ChatEncoder:
    """Encodes chat records with one tokenizer and chat template; see the module docstring."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        template: ChatTemplate,
        *,
        train_on: TrainOn | None = None,
        messages_key: str = "messages",
        prompt_key: str = "prompt",
        completion_key: str = "completion",
        template_kwargs: Mapping[str, Any] | None = None,
    ):
        if train_on is not None and train_on not in TRAIN_ON:
            raise ConfigError(f"train_on={train_on!r} is not one of {', '.join(TRAIN_ON)}")
        self.tokenizer, self.template, self.train_on = tokenizer, template, train_on
        self.keys = (messages_key, prompt_key, completion_key)
        self.template_kwargs = dict(template_kwargs or {})
        # What the template writes before an assistant's words (the generation prompt) and the
        # special token right after them (that closes the turn), from a probe conversation.
        try:
            asked = self.render(_PROBE[:1], add_generation_prompt=True)
            plain, probe = self.render(_PROBE[:1]), self.render(_PROBE)
        except DataError as e:
            message = str(e).replace("this conversation", "a user and an assistant turn")
            raise DataError(message) from None
        self.generation_prompt = asked[len(plain) :] if asked.startswith(plain) else ""
        words = probe.rfind(_PROBE[1]["content"])
        tail = probe[words + len(_PROBE[1]["content"]) :] if words >= 0 else ""
        ids, offsets = tokenizer.encode_with_offsets(tail)
        closing = [
            (i, tail[a:b])
            for i, (a, b) in zip(ids, offsets, strict=True)
            if b > a and not tokenizer.decode([i])
        ]
        self.end_of_turn = closing[0][1] if closing else None
        stops = [tokenizer.eos_id, *([int(closing[0][0])] if closing else [])]
        self.stop_ids = tuple(dict.fromkeys(stops))

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False
    ) -> str:
        """The template's text for checked `messages`, as transformers renders it."""
        return self.template.render(
            messages, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def encode(self, record: Mapping[str, Any]) -> EncodedChat:
        """The ids and trained mask of a record: `messages`, or `prompt` and `completion`."""
        messages_key, prompt_key, completion_key = self.keys
        if isinstance(record, Mapping) and messages_key in record:
            both = [key for key in (prompt_key, completion_key) if key in record]
            if both:
                raise DataError(
                    f"a chat record has {messages_key!r} and {' and '.join(map(repr, both))}, so "
                    f"which one to train on is ambiguous; keep {messages_key!r} or "
                    f"{prompt_key!r} and {completion_key!r}, not both"
                )
            return self.encode_messages(record[messages_key], train_on=self.train_on or "assistant")
        if isinstance(record, Mapping) and prompt_key in record and completion_key in record:
            train_on = self.train_on or "completion"
            return self.encode_prompt_completion(
                record[prompt_key], record[completion_key], train_on=train_on
            )
        if isinstance(record, Mapping):
            found = f"has keys {', '.join(map(repr, record))}" if record else "has no keys"
        else:
            found = f"is {_describe(record)}"
        raise DataError(
            f"a chat record needs {messages_key!r}, or {prompt_key!r} and {completion_key!r}; "
            f"this one {found}"
        )

    def encode_messages(self, messages: Any, *, train_on: TrainOn = "assistant") -> EncodedChat:
        messages = checked_messages(messages, self.keys[0])
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        selected = assistant[-1:] if train_on == "completion" else assistant
        return self._encode_conversation(messages, selected, train_on, "the conversation")

    def encode_prompt_completion(
        self, prompt: Any, completion: Any, *, train_on: TrainOn = "completion"
    ) -> EncodedChat:
        _, prompt_key, completion_key = self.keys
        if isinstance(prompt, str) and isinstance(completion, str):
            return self._encode_text(prompt, completion, train_on)
        if not isinstance(prompt, list | tuple) or not isinstance(completion, list | tuple):
            raise DataError(
                f"{prompt_key!r} and {completion_key!r} must both be strings or both lists of messages, "
                f"not {type(prompt).__name__} and {type(completion).__name__}"
            )
        messages = checked_messages(prompt, prompt_key) + checked_messages(
            completion, completion_key
        )
        first = 0 if train_on == "assistant" else len(prompt)
        selected = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
        return self._encode_conversation(
            messages, selected, train_on, "the completion" if first else "the conversation"
        )

    def render_generation_prompt(self, messages: Any) -> GenerationPrompt:
        """The ids to generate from after `messages` (add_generation_prompt=True) and the ids to
        stop at."""
        text = self.render(checked_messages(messages, self.keys[0]), add_generation_prompt=True)
        return GenerationPrompt(self.tokenizer.encode_with_offsets(text)[0], self.stop_ids)

    def _encode_text(self, prompt: str, completion: str, train_on: TrainOn) -> EncodedChat:
        """trl's prompt-completion of plain text: prompt + completion + eos tokenized as one text
        with the tokenizer's specials; trained after the tokens it shares with the prompt alone."""
        eos = self.template.special_tokens.get("eos_token")
        if eos is not None and not completion.endswith(eos):
            completion += eos
        ids = self.tokenizer.encode_with_offsets(prompt + completion, add_special_tokens=True)[0]
        if eos is None:
            ids = np.append(ids, np.int32(self.tokenizer.eos_id))
        prompt_ids = self.tokenizer.encode_with_offsets(prompt, add_special_tokens=True)[0]
        shared = min(len(ids), len(prompt_ids))
        differ = np.flatnonzero(ids[:shared] != prompt_ids[:shared])
        start = 0 if train_on == "all" else int(differ[0]) if differ.size else shared
        return EncodedChat(ids, np.arange(len(ids)) >= start)

    def _encode_conversation(
        self, messages: list[dict], selected: list[int], train_on: TrainOn, what: str
    ) -> EncodedChat:
        text = self.render(messages)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        if train_on == "all":
            trained = np.ones(len(ids), bool)
        else:
            trained = np.zeros(len(ids), bool)
            for i, (start, end) in self._assistant_spans(messages, text).items():
                if i in selected:  # every token that overlaps the turn's characters
                    trained |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
        if not trained.any():
            reason = (
                f"{what} has no assistant turn" if not selected else "its assistant turns are empty"
            )
            raise DataError(f"nothing to train in this record: {reason} (train_on={train_on})")
        return EncodedChat(ids, trained)

    def _assistant_spans(self, messages: list[dict], text: str) -> dict[int, tuple[int, int]]:
        """The characters [start, end) of `text` that each assistant turn writes: from the end of
        the generation prompt through the token that closes the turn."""
        spans, cursor = {}, 0
        header = self.generation_prompt.partition("\n")
        core = header[0] + header[1]  # its first line: `<|im_start|>assistant\n`
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = self._prefix_end(messages[:i], text, cursor)
            if start is None:  # a template that renders earlier turns differently at the end
                found = text.find(core, cursor) if core else -1
                if found < 0:
                    raise DataError(
                        f"cannot find assistant turn {i} of the conversation in what the chat "
                        f"template {self.template.origin} renders"
                    )
                start = found + len(core)
                while (
                    start - found < len(self.generation_prompt)
                    and text[start : start + 1] == self.generation_prompt[start - found]
                ):
                    start += 1
            content = message["content"].strip()
            at = text.find(content, start) if content else start
            words_end = (
                at + len(content) if at >= 0 and (not core or core not in text[start:at]) else start
            )
            closing = text.find(self.end_of_turn, words_end) if self.end_of_turn else -1
            end = closing + len(self.end_of_turn) if closing >= 0 else words_end
            spans[i], cursor = (start, end), end
        return spans

    def _prefix_end(self, before: list[dict], text: str, cursor: int) -> int | None:
        """Where the assistant's words start: after the rendering of the turns before it with the
        generation prompt, if that is how `text` starts (past `cursor`)."""
        if not before:
            return None
        try:
            prefix = self.render(before, add_generation_prompt=True)
        except DataError:
            return None
        return len(prefix) if text.startswith(prefix) and len(prefix) >= cursor else None


def build_chat_encoder(
    tokenizer: str, chat_template: str | None = None, **options: Any
) -> ChatEncoder:
    """The ChatEncoder of data.tokenizer and data.chat_template; `options` as ChatEncoder's."""
    template = load_chat_template(tokenizer, chat_template)
    loaded = build_tokenizer(tokenizer)
    if not isinstance(loaded, HFTokenizer):
        raise DataError(
            f"data.tokenizer={tokenizer!r}: chat data needs a Hugging Face tokenizer.json"
        )
    return ChatEncoder(loaded, template, **options)
