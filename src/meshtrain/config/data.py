"""The `data:` keys of a run (config.schema.Config.data): where sequences come from and how they
are read, tokenised and packed; every field typed, with its default and a one-line docstring."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from meshtrain.config.caches import AUTO_CACHE

DataSource = Literal["text", "prepared", "synthetic", "chat", "preference", "prompts"]
"""data.source: local documents (tokenised once into the data cache), a directory made by
`python -m meshtrain.data.prepare`, random tokens, conversations, preference pairs, or prompts to
sample completions from (objective=grpo)."""
BadRecordPolicy = Literal["error", "skip"]
"""data.on_bad_record."""
DataVerify = Literal["quick", "full"]
"""data.verify: how opening a prepared directory checks its token files (meshtrain.data.integrity)."""
TrainOn = Literal["assistant", "completion", "all"]
"""data.train_on (chat data): the tokens that carry loss."""
Overlong = Literal["truncate", "drop", "error"]
"""data.overlong (chat data): a conversation longer than data.seq_len + 1 tokens."""
Packing = Literal["first_fit", "in_order"]
"""data.packing (chat data): how whole conversations fill the rows (meshtrain.data.chat.packing)."""


@dataclass
class MixtureSource:
    """One source of data.mixture."""

    name: str = "source"
    """Names the source in logs, metrics.jsonl (data_share/<name>) and TensorBoard."""
    paths: list[str] = field(default_factory=list)
    """Files, directories or globs of documents, or directories made by meshtrain.data.prepare."""
    weight: float = 1.0
    """Relative share of the training sequences drawn from this source; must be > 0."""


@dataclass
class DataConfig:
    source: str = "text"  # DataSource
    """Where sequences come from: text (local documents), prepared (a meshtrain.data.prepare directory), synthetic (random tokens), chat (conversations) or preference (pairs of answers: prompt, chosen, rejected)."""
    paths: list[str] = field(default_factory=list)
    """text: files, directories or globs; the format comes from the extension (.jsonl, .jsonl.gz, .parquet; any other file is one document). Empty: data.path and data.glob."""
    path: str | None = None
    """text without data.paths: the directory data.glob searches (null: the Python standard library's own source). prepared: the prepared directory."""
    glob: str | None = "**/*.py"
    """Pattern, relative to `path`, of the documents to read (text without data.paths); null: none (data=text)."""
    text_key: str = "text"
    """The field of a .jsonl record, or the column of a .parquet file, that holds the text."""
    messages_key: str = "messages"
    """chat: the field or column of a conversation, a list of {role, content} (system, user, assistant)."""
    prompt_key: str = "prompt"
    """chat, preference and prompts: the field or column of a prompt (a string, or a list of messages), with completion_key (chat) or chosen_key and rejected_key (preference); prompts: the records' other columns reach the reward functions."""
    completion_key: str = "completion"
    """chat: the field or column of the completion that answers prompt_key."""
    chosen_key: str = "chosen"
    """preference: the field or column of the preferred answer (a string, or a list of messages; without prompt_key, a whole conversation)."""
    rejected_key: str = "rejected"
    """preference: the field or column of the answer not preferred, in the form of chosen_key."""
    shared_prompt: bool = True
    """preference: a pair is packed as its prompt once, then each answer, which sees the prompt and not the other answer (the same log-probabilities as prompt + answer, in fewer tokens); false: prompt + chosen, then prompt + rejected, as trl feeds them. Needs attention over the whole sequence (no sliding window shorter than data.seq_len). prompts: a train row holds the prompt once and K of its completions after it (K: the most of objective.num_generations that divide each device's completions and fit the sliding window, if any; docs/rl.md); false: a row per completion."""
    chat_template: str | None = None
    """chat, preference and prompts: a .jinja file rendering conversations; null: the tokenizer's own (tokenizer_config.json or chat_template.jinja)."""
    train_on: str | None = None  # TrainOn
    """chat: the tokens that carry loss: assistant (every assistant turn), completion (the completion; for messages, the last assistant turn) or all; null: assistant for messages, completion for prompt/completion."""
    overlong: str = "truncate"  # Overlong
    """chat: a conversation longer than data.seq_len + 1 tokens is truncated (counted in the log), dropped (counted) or an error; preference: the same for a pair (chosen and rejected together), truncation cutting each answer's end."""
    packing: str = "first_fit"  # Packing
    """chat and preference: first_fit puts each conversation (pair) in the first of the 8 most recently opened rows it fits, in data order (fewer rows, less padding); in_order fills one row at a time, starting the next when one does not fit."""
    mixture: list[MixtureSource] = field(default_factory=list)
    """Sources sampled by weight, deterministically from training.seed ([{name, paths, weight}, ...]); replaces data.paths."""
    document_masking: bool = True
    """Attention stays inside each packed document, whose positions restart at 0 (text and prepared data)."""
    tokenizer: str = "byte"
    """byte (256 byte values plus pad, bos, eos), a tokenizer.json, a sentencepiece .model, or an HF dir."""
    seq_len: int = 128
    """Tokens per training sequence (each example holds seq_len + 1 tokens: inputs and shifted targets)."""
    validation_fraction: float = 0.05
    """Share of documents held out for validation, chosen by a stable hash of each document's file and record."""
    validation_paths: list[str] = field(default_factory=list)
    """Held-out files, directories or globs (or prepared directories) to validate on instead of validation_fraction."""
    on_bad_record: str = "error"  # BadRecordPolicy
    """A bad record (invalid JSON line, missing text, undecodable bytes, unreadable parquet): error (exit 2, naming file and line) or skip (counted in the log)."""
    workers: int = 2
    """Threads reading the next batches ahead of the train step; 0 reads each batch when it is due."""
    cache_dir: str | None = AUTO_CACHE
    """Tokenised text sources, keyed by the files (paths, sizes, mtimes), tokenizer and text_key: auto (<cache root>/data), a directory, or null (tokenise at every launch)."""
    verify: str = "quick"  # DataVerify
    """What opening a prepared directory or data cache entry checks against its manifest: quick (every file's presence, header, size and a sampled checksum: milliseconds) or full (a checksum of every byte and every token id: reads the whole corpus)."""
