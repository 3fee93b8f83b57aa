"""scripts/benchmark_data.py's inputs: a corpus of synthetic English-like documents (words of a
fixed vocabulary drawn with Zipf-like frequencies by a seeded numpy generator) as one .jsonl, and
a byte-level BPE tokenizer.json trained on its first megabytes. Nothing is downloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SPECIALS = ("<pad>", "<bos>", "<eos>")
MB = 10**6


def word_list(rng: np.random.Generator, size: int = 6000) -> list[str]:
    """`size` distinct pronounceable words, then the 300 most frequent again ending in "." and
    the 200 most frequent ending in "," (sentences and clauses)."""
    onsets = [
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "j",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "br",
        "cr",
        "dr",
        "fr",
        "gr",
        "pl",
        "pr",
        "st",
        "tr",
        "th",
        "sh",
        "ch",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou"]
    codas = ["", "", "n", "s", "t", "r", "l", "nd", "st", "ng"]
    words: dict[str, None] = dict.fromkeys(
        ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "with"]
    )
    while len(words) < size:
        syllables = rng.integers(1, 4)
        word = "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables)
        )
        words[word] = None
    base = list(words)
    return base + [w + "." for w in base[:300]] + [w + "," for w in base[:200]]


def documents(seed: int) -> Iterator[str]:
    """Synthetic documents, forever: 20 to ~4000 words (log-normal), Zipf-like word frequencies."""
    rng = np.random.default_rng(seed)
    words = np.array(word_list(rng), dtype=object)
    weights = 1.0 / (np.arange(len(words)) + 2.7)
    weights /= weights.sum()
    while True:
        lengths = np.clip(rng.lognormal(5.5, 0.9, 256).astype(int), 20, 4000)
        drawn = words[rng.choice(len(words), int(lengths.sum()), p=weights)]
        ends = np.cumsum(lengths)
        for start, end in zip(ends - lengths, ends, strict=True):
            text = " ".join(drawn[start:end])
            yield text[0].upper() + text[1:]


def write_corpus(path: Path, target_bytes: int, seed: int = 0) -> tuple[int, int]:
    """Writes documents to the .jsonl `path` until it holds `target_bytes`; returns (bytes,
    documents)."""
    size = count = 0
    with path.open("w", encoding="utf-8") as f:
        for text in documents(seed):
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size, count = size + len(line), count + 1
            if size >= target_bytes:
                break
    return size, count


def corpus_texts(path: Path, sample_bytes: int) -> Iterator[str]:
    """The texts of the first `sample_bytes` of the .jsonl `path`."""
    seen = 0
    with path.open(encoding="utf-8") as f:
        for line in f:
            seen += len(line)
            yield json.loads(line)["text"]
            if seen >= sample_bytes:
                return


def train_tokenizer(directory: Path, corpus: Path, sample_bytes: int, vocab_size: int) -> Path:
    """A byte-level BPE tokenizer.json trained on the corpus's first `sample_bytes`, with <pad>,
    <bos>, <eos> as ids 0, 1, 2 named in a tokenizer_config.json beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    tokenizer.train_from_iterator(corpus_texts(corpus, sample_bytes), trainer)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    config = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return path
