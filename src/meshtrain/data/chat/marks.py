"""Marks carried in the high bits of a batch's int32 token ids (chat data, data.source=chat).

A batch stays one int32 array [..., seq_len + 1] through every split (processes, gradient
accumulation, pipeline micro-batches), so the marks travel with the ids and the step reads both
where it reads the tokens (meshtrain.train.documents.TokenFormat). Text data carries no marks:
its ids are the tokenizer's, and the step reads them as before.

    bit 30  NOT_TRAINED     as a target, this token carries no loss (prompt, template, padding)
    bit 29  DOCUMENT_START  a packed conversation starts at this token (document masking)
    bits 0-28               the token id (vocabularies up to 2**29 = 536,870,912 ids)
"""

from __future__ import annotations

NOT_TRAINED = 1 << 30
DOCUMENT_START = 1 << 29
ID_BITS = DOCUMENT_START - 1
MAX_VOCAB = DOCUMENT_START
