"""Packs tokenized documents into fixed-length training sequences."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshtrain.data.tokenizer import NO_TOKEN


def pack_documents(
    token_arrays: Sequence[np.ndarray], seq_len: int, *, bos_id: int, eos_id: int, pad_id: int
) -> np.ndarray:
    """Returns int32 [num_sequences, seq_len + 1]: `[bos] + doc + [eos]` for every document, as one
    stream cut into consecutive non-overlapping windows; the last window is padded with pad_id.

    A tokenizer without bos (bos_id = NO_TOKEN) packs `doc + [eos]`; one without pad
    (pad_id = NO_TOKEN) drops the incomplete last window instead of padding it.
    """
    if seq_len < 1:
        raise ValueError(f"data.seq_len={seq_len} must be at least 1")
    width = seq_len + 1
    specials = 1 if bos_id == NO_TOKEN else 2
    lengths = np.fromiter((len(a) for a in token_arrays), dtype=np.int64, count=len(token_arrays))
    total = int(lengths.sum()) + specials * len(lengths)
    num_sequences = -(-total // width)
    stream = np.full(num_sequences * width, pad_id, dtype=np.int32)  # [num_sequences * width]
    if total == 0:
        return stream.reshape(num_sequences, width)
    # Each document occupies its length plus its special slots; fill specials by index and the
    # content through a mask, so no Python loop runs over the ~100M tokens.
    ends = np.cumsum(lengths + specials)  # exclusive end of each [bos, doc, eos] block
    starts = ends - lengths - specials
    is_content = np.ones(total, dtype=bool)
    if bos_id != NO_TOKEN:
        is_content[starts] = False
        stream[starts] = bos_id
    is_content[ends - 1] = False
    stream[ends - 1] = eos_id
    stream[:total][is_content] = np.concatenate(token_arrays)
    if pad_id == NO_TOKEN:
        num_sequences = total // width
    return stream[: num_sequences * width].reshape(num_sequences, width)
