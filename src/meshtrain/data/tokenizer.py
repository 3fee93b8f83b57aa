"""Tokenizers that turn document text into int32 ids; `byte` is UTF-8 bytes plus three specials."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> np.ndarray: ...
    def encode_bytes(self, data: bytes) -> np.ndarray: ...
    def decode(self, ids: np.ndarray | list[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are byte values; 256, 257 and 258 are pad, bos and eos."""

    pad_id = 256
    bos_id = 257
    eos_id = 258
    vocab_size = 259

    def encode(self, text: str) -> np.ndarray:
        """Returns the UTF-8 bytes of `text` as int32 ids, without specials."""
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Returns raw file bytes as ids: for this tokenizer no decoding is needed, which keeps loading fast."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Returns the text of the byte ids, dropping specials; invalid UTF-8 becomes U+FFFD."""
        ids = np.asarray(ids)
        return (
            ids[(ids >= 0) & (ids < 256)]
            .astype(np.uint8)
            .tobytes()
            .decode("utf-8", errors="replace")
        )


def build_tokenizer(name: str) -> Tokenizer:
    """Returns the tokenizer named by `data.tokenizer`."""
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"data.tokenizer={name!r} is not supported; use data.tokenizer=byte")
