"""Marks carried in the high bits of a batch's int32 token ids (chat data, data.source=chat).

A batch stays one int32 array [..., seq_len + 1] through every split (processes, gradient
accumulation, pipeline micro-batches), so the marks travel with the ids and the step reads both
where it reads the tokens (meshtrain.train.documents.TokenFormat). Text data carries no marks:
its ids are the tokenizer's, and the step reads them as before.

    bit 30  NOT_TRAINED     as a target, this token carries no loss (prompt, template, padding)
    bit 29  DOCUMENT_START  a packed conversation starts at this token (document masking)
    bit 28  BRANCH_START    a branch of the document starts at this token: the tokens from here
                            to the next branch see the document's tokens before its first branch
                            and their own, not another branch's (a pair's answers after their
                            shared prompt, meshtrain.data.chat.pairs)
    bits 0-27               the token id (vocabularies up to 2**28 = 268,435,456 ids)
"""

from __future__ import annotations

NOT_TRAINED = 1 << 30
DOCUMENT_START = 1 << 29
BRANCH_START = 1 << 28
ID_BITS = BRANCH_START - 1
MAX_VOCAB = BRANCH_START
