"""Chat data: conversations and preference pairs rendered with a Hugging Face chat template as
transformers renders them, the tokens marked for the loss, and packed into training sequences.

- `template`: the template found and rendered as transformers does (jinja2 in its sandbox).
- `encoder`: a conversation (messages, or prompt + completion) → ids and the tokens to train.
- `pairs`: a preference record (prompt, chosen, rejected) → its two sequences, as trl does.
- `marks`: the marks (not trained, document start) carried in the high bits of the ids.
- `records`: the ids a prepared unit stores for each record, and the options that define them.
- `packing`: whole conversations (and pairs) packed into windows of seq_len + 1 tokens.
"""
