"""Tokenizers that turn document text into int32 ids: `byte` (UTF-8 bytes plus three specials),
a Hugging Face tokenizer.json, or a sentencepiece .model file.

The special tokens come from the tokenizer itself: for tokenizer.json from the
tokenizer_config.json beside it (as Hugging Face checkpoints ship it), else from the usual names
(<bos>, <s>, <|begin_of_text|>, ...). An id of -1 means the tokenizer has no such token: no bos
(Qwen) packs documents as doc + eos; no pad drops the incomplete last window instead of padding it.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Protocol

import numpy as np
import sentencepiece
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizerModel

NO_TOKEN = -1
# Spellings of the special tokens in common tokenizers, tried in order when no
# tokenizer_config.json names them (Gemma, Llama 2, Llama 3, GPT-2 / Qwen).
_USUAL_NAMES = {
    "bos": ("<bos>", "<s>", "<|begin_of_text|>"),
    "eos": ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>"),
    "pad": ("<pad>", "<|finetune_right_pad_id|>", "[PAD]"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# Files that come with a tokenizer in a Hugging Face directory; export copies those present.
COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class Tokenizer(Protocol):
    vocab_size: int  # ids are in [0, vocab_size), special tokens included
    pad_id: int  # NO_TOKEN (-1) if there is none
    bos_id: int  # NO_TOKEN (-1) if there is none
    eos_id: int
    source_files: tuple[Path, ...]  # what export copies next to the weights

    def encode(self, text: str) -> np.ndarray: ...
    def encode_bytes(self, data: bytes) -> np.ndarray: ...
    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...
    def decode(self, ids: np.ndarray | list[int]) -> str: ...


BYTE_SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 256, 257, 258 of ByteTokenizer


class ByteTokenizer:
    """Ids 0..255 are byte values; 256, 257 and 258 are pad, bos and eos."""

    pad_id = 256
    bos_id = 257
    eos_id = 258
    vocab_size = 259
    source_files: tuple[Path, ...] = ()

    def encode(self, text: str) -> np.ndarray:
        """Returns the UTF-8 bytes of `text` as int32 ids, without specials."""
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Returns raw file bytes as ids: for this tokenizer no decoding is needed, which keeps loading fast."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Returns each text's int32 ids [len(text.encode())], without specials."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Returns the text of the byte ids, dropping specials; invalid UTF-8 becomes U+FFFD."""
        ids = np.asarray(ids)
        return (
            ids[(ids >= 0) & (ids < 256)]
            .astype(np.uint8)
            .tobytes()
            .decode("utf-8", errors="replace")
        )


def _byte_level_alphabet() -> dict[int, str]:
    """byte → the printable character that stands for it in a byte-level tokenizer.json (GPT-2's
    table: printable Latin-1 bytes are themselves, the others are shifted past U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    shifted = [b for b in range(256) if b not in printable]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(256 + i) for i, b in enumerate(shifted)},
    }


def byte_tokenizer_json() -> HFTokenizerModel:
    """ByteTokenizer as a Hugging Face tokenizer: byte b is id b, then <pad>, <bos>, <eos> as
    256, 257, 258. It encodes any text to the same ids as ByteTokenizer, except that the literal
    strings <pad>, <bos> and <eos> become their special tokens."""
    alphabet = _byte_level_alphabet()
    tokenizer = HFTokenizerModel(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in BYTE_SPECIALS])
    return tokenizer


def _distinct_pad(pad_id: int, bos_id: int, eos_id: int) -> int:
    """A pad that is also bos or eos (Qwen pads with <|endoftext|>) would hide those tokens from
    the loss, so it counts as no pad at all."""
    return NO_TOKEN if pad_id in (bos_id, eos_id) else pad_id


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (BPE, Unigram, WordPiece...)."""

    def __init__(self, path: Path):
        self._tokenizer = HFTokenizerModel.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        config_file = path.parent / "tokenizer_config.json"
        named = _configured_tokens(config_file) if config_file.is_file() else {}
        ids = {}
        for role, names in _USUAL_NAMES.items():
            candidates = (named[role],) if role in named else names
            found = [self._tokenizer.token_to_id(n) for n in candidates if n is not None]
            ids[role] = next((i for i in found if i is not None), NO_TOKEN)
        if ids["eos"] == NO_TOKEN:
            raise ValueError(
                f"data.tokenizer={str(path)!r} has no end-of-sequence token; name it as eos_token "
                f"in {config_file}"
            )
        self.bos_id, self.eos_id = ids["bos"], ids["eos"]
        self.pad_id = _distinct_pad(ids["pad"], self.bos_id, self.eos_id)
        self.source_files = (
            path,
            *[f for f in (path.parent / n for n in COMPANION_FILES) if f.is_file()],
        )

    def encode(self, text: str) -> np.ndarray:
        """Returns the ids of `text` without specials (packing adds bos and eos)."""
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Returns each text's int32 ids without specials; the Rust tokenizer encodes the batch
        on all cores (TOKENIZERS_PARALLELISM), much faster than one encode per text."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encodings]

    def adds_bos(self) -> bool:
        """Whether the tokenizer.json's own rule (its post-processor) starts a text with bos,
        as transformers' tokenizer does when asked for its special tokens."""
        ids = self._tokenizer.encode("a", add_special_tokens=True).ids
        return self.bos_id >= 0 and ids[:1] == [self.bos_id]

    def encode_with_offsets(
        self, text: str, *, add_special_tokens: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Returns the int32 ids [n] of `text` and each token's [start, end) character offsets in
        it, int64 [n, 2] (what tells a chat's assistant tokens apart). No specials by default, as
        transformers' apply_chat_template tokenizes a rendered chat; with them, the bos or eos
        the tokenizer.json adds (offsets (0, 0))."""
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, np.int32), offsets

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Returns the ids of a file's UTF-8 text; invalid bytes become U+FFFD."""
        return self.encode(data.decode("utf-8", errors="replace"))

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def _configured_tokens(config_file: Path) -> dict[str, str | None]:
    """bos/eos/pad token strings named in a tokenizer_config.json (a string or {"content": ...})."""
    config = json.loads(config_file.read_text())
    named = {}
    for role in _USUAL_NAMES:
        if f"{role}_token" in config:
            value = config[f"{role}_token"]
            named[role] = value.get("content") if isinstance(value, dict) else value
    return named


class SentencePieceTokenizer:
    """A sentencepiece .model file (Gemma, Llama 2); its special ids are in the model itself."""

    def __init__(self, path: Path):
        self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._processor.get_piece_size()
        self.bos_id, self.eos_id = self._processor.bos_id(), self._processor.eos_id()
        if self.eos_id < 0:
            raise ValueError(
                f"data.tokenizer={str(path)!r} has no end-of-sequence token; train it with an eos_id"
            )
        self.pad_id = _distinct_pad(self._processor.pad_id(), self.bos_id, self.eos_id)
        self.source_files = (path,)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._processor.encode(text), np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Returns each text's int32 ids; sentencepiece encodes a list in one call."""
        return [np.asarray(ids, np.int32) for ids in self._processor.encode(texts)]

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return self.encode(data.decode("utf-8", errors="replace"))

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return self._processor.decode([int(i) for i in ids])


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """Writes `tokenizer` into `directory` under the names transformers and `build_tokenizer`
    look for: its tokenizer.json or tokenizer.model, then its companions. The byte tokenizer is
    written as an equivalent tokenizer.json (byte_tokenizer_json); a tokenizer.json without a
    tokenizer_config.json gets one naming its special tokens."""
    if isinstance(tokenizer, ByteTokenizer):
        byte_tokenizer_json().save(str(directory / "tokenizer.json"))
    elif tokenizer.source_files:
        main, *companions = tokenizer.source_files
        shutil.copyfile(main, directory / f"tokenizer{main.suffix}")
        for source in companions:
            shutil.copyfile(source, directory / source.name)
    if (directory / "tokenizer.json").is_file() and not (
        directory / "tokenizer_config.json"
    ).exists():
        roles = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id}
        named = HFTokenizerModel.from_file(str(directory / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{f"{r}_token": named.id_to_token(i) for r, i in roles.items() if i >= 0},
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_tokenizer(name: str) -> Tokenizer:
    """Returns the tokenizer named by `data.tokenizer`: byte, a tokenizer.json, a sentencepiece
    .model, or a directory holding one of them (a Hugging Face checkpoint)."""
    if name == "byte":
        return ByteTokenizer()
    path = Path(name).expanduser()
    if path.is_dir():
        found = [path / f for f in TOKENIZER_FILES if (path / f).is_file()]
        if not found:
            raise ValueError(
                f"data.tokenizer={name!r} is a directory without {' or '.join(TOKENIZER_FILES)}"
            )
        path = found[0]
    if not path.is_file():
        raise ValueError(
            f"data.tokenizer={name!r} is not supported; use byte, a tokenizer.json file, a "
            "sentencepiece .model file, or a directory holding one"
        )
    if path.suffix not in (".json", ".model"):
        raise ValueError(
            f"data.tokenizer={name!r}: unknown tokenizer file type {path.suffix!r}; use a "
            "tokenizer.json (Hugging Face tokenizers) or a .model (sentencepiece) file"
        )
    files = [path, *(path.parent / n for n in COMPANION_FILES)]
    return _load_tokenizer(path.resolve(), tuple(_stamp(f) for f in files))


def _stamp(path: Path) -> tuple[int, int] | None:
    """(size, modification time) of a file, None if it is absent."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: Path, stamps: tuple[tuple[int, int] | None, ...]) -> Tokenizer:
    """The tokenizer in `path`, loaded once per version of it and its companion files
    (`stamps`): a start-up asks for it several times (the data splits, the cache key, document
    masking), and a large tokenizer.json takes a second to load."""
    return HFTokenizer(path) if path.suffix == ".json" else SentencePieceTokenizer(path)
