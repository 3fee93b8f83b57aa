"""Tokenizers trained here on a few kilobytes of text: a byte-level BPE tokenizer.json (Hugging
Face tokenizers) and a sentencepiece .model. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEXT = "\n".join(
    f"def function_{i}(value):\n    return value * {i} + len('meshtrain tokenizer test {i}')\n"
    for i in range(200)
)
SPECIALS = ("<pad>", "<bos>", "<eos>")


def train_bpe(directory: Path, vocab_size: int = 300, *, config: dict | None = None) -> Path:
    """A byte-level BPE tokenizer.json with <pad>, <bos>, <eos> as ids 0, 1, 2; `config` is
    written beside it as tokenizer_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXT.splitlines(), trainer)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def train_sentencepiece(directory: Path, vocab_size: int = 200) -> Path:
    """A unigram sentencepiece model with pad 0, eos 1, bos 2, unk 3 (Gemma's order)."""
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text(TEXT)
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=vocab_size,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    return directory / "tokenizer.model"
