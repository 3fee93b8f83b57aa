"""Preference records → pairs of sequences (meshtrain.data.chat.pairs), as trl's DPOTrainer
tokenizes them: the prompt's tokens shared, the answers trained, the pair stored as one unit
(the prompt once and two branches, or chosen then rejected with DOCUMENT_START) and packed
whole; every bad record is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.paths import REPO

from meshtrain.data.chat.encoder import build_chat_encoder
from meshtrain.data.chat.marks import BRANCH_START, DOCUMENT_START, ID_BITS, NOT_TRAINED
from meshtrain.data.chat.packing import PackedConversations, truncated_pair
from meshtrain.data.chat.pairs import (
    PairEncoder,
    PreferenceKeys,
    common_prefix_length,
    pair_bounds,
    split_implicit_prompt,
)
from meshtrain.data.chat.records import flagged_ids, preference_options_for, record_keys
from meshtrain.errors import DataError

FIXTURES = REPO / "tests" / "fixtures" / "chat"
PROMPT = [{"role": "user", "content": "What is 2+2?"}]
CHOSEN = [{"role": "assistant", "content": "4"}]
REJECTED = [{"role": "assistant", "content": "It is five."}]


@pytest.fixture(scope="module")
def qwen3():
    return PairEncoder(build_chat_encoder(str(FIXTURES / "qwen3")))


def _text(encoder: PairEncoder, ids: np.ndarray) -> str:
    return encoder.chat.tokenizer.decode([int(i) for i in ids])


def test_a_conversational_pair_is_the_template_rendering_of_prompt_and_answer(qwen3):
    pair = qwen3.encode({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED})
    chat = qwen3.chat
    for ids, answer in ((pair.chosen, CHOSEN), (pair.rejected, REJECTED)):
        whole = chat.tokenizer.encode_with_offsets(chat.render(PROMPT + answer))[0]
        np.testing.assert_array_equal(ids, whole)
    prompt = chat.tokenizer.encode_with_offsets(chat.render(PROMPT, add_generation_prompt=True))[0]
    assert pair.prompt_length == len(prompt)  # Qwen 3's prompt is a prefix of both renderings
    np.testing.assert_array_equal(pair.chosen[: pair.prompt_length], prompt)
    # The answers as trl trains them: after the generation prompt, through the end of the turn
    # (<|im_end|>, id 402 of the fixture) and the template's newline; Qwen 3 writes an empty
    # think block in the last turn.
    assert _text(qwen3, pair.chosen[pair.prompt_length :]) == "<think>\n\n</think>\n\n4\n"
    assert _text(qwen3, pair.rejected[pair.prompt_length :]).endswith("</think>\n\nIt is five.\n")
    assert pair.chosen[-2] == pair.rejected[-2] == 402


def test_the_stored_unit_marks_the_prompts_and_the_rejected_start(qwen3):
    pair = qwen3.encode({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED})
    unit = pair.flagged(shared_prompt=False)
    n, p = len(pair.chosen), pair.prompt_length
    assert unit.dtype == np.uint32 and len(unit) == n + len(pair.rejected)
    np.testing.assert_array_equal(unit & ID_BITS, np.concatenate([pair.chosen, pair.rejected]))
    trained = (unit & NOT_TRAINED) == 0
    assert trained.tolist() == [i >= p for i in range(n)] + [
        i >= p for i in range(len(pair.rejected))
    ]
    assert np.flatnonzero(unit & DOCUMENT_START).tolist() == [n]  # the packer marks the first
    assert not (unit & BRANCH_START).any()
    assert pair_bounds(unit | np.uint32(DOCUMENT_START) * (np.arange(len(unit)) == 0)) == (0, n)


def test_the_shared_unit_holds_the_prompt_once_and_each_answer_after_its_last_token(qwen3):
    pair = qwen3.encode({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED})
    unit = pair.flagged(shared_prompt=True)
    n, m, p = len(pair.chosen), len(pair.rejected), pair.prompt_length
    assert (p, n, m) == (19, 28, 35)  # the fixture's Qwen 3 rendering
    assert len(unit) == n + m - (p - 1)  # the prompt's first p - 1 tokens once
    ids = unit & ID_BITS
    np.testing.assert_array_equal(ids[:n], pair.chosen)  # the prompt, then the chosen branch
    np.testing.assert_array_equal(ids[n:], pair.rejected[p - 1 :])  # its last token, the answer
    assert np.flatnonzero(unit & BRANCH_START).tolist() == [p - 1, n]
    assert not (unit & DOCUMENT_START).any()
    trained = ((unit & NOT_TRAINED) == 0).tolist()
    assert trained == [i >= p for i in range(n)] + [False] + [True] * (m - p)
    assert pair_bounds(unit) == (p - 1, n)


def test_plain_strings_are_tokenized_with_specials_and_end_in_eos():
    gemma = PairEncoder(build_chat_encoder(str(FIXTURES / "gemma3")))
    pair = gemma.encode({"prompt": "Q: 2+2? A:", "chosen": " 4", "rejected": " five"})
    tokenizer = gemma.chat.tokenizer
    expected = tokenizer.encode_with_offsets("Q: 2+2? A: 4<eos>", add_special_tokens=True)[0]
    np.testing.assert_array_equal(pair.chosen, expected)
    assert pair.chosen[0] == tokenizer.bos_id and pair.chosen[-1] == tokenizer.eos_id
    prompt = tokenizer.encode_with_offsets("Q: 2+2? A:", add_special_tokens=True)[0]
    assert pair.prompt_length == common_prefix_length(prompt, pair.chosen)
    assert _text(gemma, pair.rejected[pair.prompt_length :]).endswith("five")


def test_an_implicit_prompt_is_the_turns_the_answers_share(qwen3):
    chosen, rejected = PROMPT + CHOSEN, PROMPT + REJECTED
    assert split_implicit_prompt(chosen, rejected) == (PROMPT, CHOSEN, REJECTED)
    assert split_implicit_prompt("Q: hi there", "Q: hi you") == ("Q: hi", " there", " you")
    implicit = qwen3.encode({"chosen": chosen, "rejected": rejected})
    explicit = qwen3.encode({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED})
    np.testing.assert_array_equal(implicit.chosen, explicit.chosen)
    np.testing.assert_array_equal(implicit.rejected, explicit.rejected)
    assert implicit.prompt_length == explicit.prompt_length


def test_the_keys_are_configurable(qwen3):
    keys = PreferenceKeys(prompt="question", chosen="good", rejected="bad")
    encoder = PairEncoder(qwen3.chat, keys)
    pair = encoder.encode({"question": PROMPT, "good": CHOSEN, "bad": REJECTED})
    np.testing.assert_array_equal(
        pair.chosen, qwen3.encode({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}).chosen
    )
    options = preference_options_for(
        str(FIXTURES / "qwen3"),
        chat_template=None,
        prompt_key="question",
        chosen_key="good",
        rejected_key="bad",
        shared_prompt=True,
    )
    assert record_keys(options) == ("question", "good", "bad")
    convert = flagged_ids(str(FIXTURES / "qwen3"), options)
    np.testing.assert_array_equal(
        convert({"question": PROMPT, "good": CHOSEN, "bad": REJECTED}),
        pair.flagged(shared_prompt=True),
    )


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"prompt": PROMPT, "chosen": CHOSEN},
            "a preference record needs 'chosen' and 'rejected' (and 'prompt', or conversations "
            "that share their first turns); this one has no 'rejected' (its keys: 'prompt', "
            "'chosen')",
        ),
        (
            {"prompt": PROMPT, "chosen": CHOSEN, "rejected": CHOSEN},
            "'chosen' equals 'rejected': the pair prefers nothing",
        ),
        (
            {"prompt": "Q:", "chosen": CHOSEN, "rejected": REJECTED},
            "'prompt', 'chosen' and 'rejected' must be three strings or three lists of messages, "
            "not str, list, list",
        ),
        (
            {"chosen": "four", "rejected": "five"},
            "a preference record without 'prompt' needs 'chosen' and 'rejected' as "
            "conversations (lists of messages) that share their first turns",
        ),
        (
            {"chosen": CHOSEN, "rejected": REJECTED},
            "'chosen' and 'rejected' share no first turn to take as the prompt; give the prompt "
            "as 'prompt'",
        ),
        (
            {"prompt": PROMPT, "chosen": [{"role": "assistant"}], "rejected": REJECTED},
            "chosen[0] has no 'content'; a message is {role, content}",
        ),
        (["not", "an", "object"], "a preference record is an object, not a list"),
    ],
)
def test_bad_records_are_one_line(qwen3, record, message):
    with pytest.raises(DataError) as error:
        qwen3.encode(record)
    assert str(error.value) == message


def test_a_long_pair_is_cut_at_the_end_of_each_sequence():
    chosen = np.arange(10, dtype=np.uint32)
    rejected = np.arange(100, 106, dtype=np.uint32)
    rejected[0] |= DOCUMENT_START
    unit = np.concatenate([chosen, rejected])
    cut = truncated_pair(unit, 12)  # 16 tokens into 12: the longer chosen keeps 6, rejected 6
    assert (cut & ID_BITS).tolist() == [*range(6), *range(100, 106)]
    assert np.flatnonzero(cut & DOCUMENT_START).tolist() == [6]
    short = truncated_pair(unit, 14)  # the rejected fits whole (6), the chosen keeps 8
    assert (short & ID_BITS).tolist() == [*range(8), *range(100, 106)]


def test_a_long_shared_pair_keeps_its_prompt_and_cuts_each_answer():
    prompt = np.arange(4, dtype=np.uint32)
    chosen, rejected = np.arange(10, 20, dtype=np.uint32), np.arange(100, 104, dtype=np.uint32)
    chosen[0] |= BRANCH_START
    rejected[0] |= BRANCH_START
    unit = np.concatenate([prompt, chosen, rejected])
    cut = truncated_pair(unit, 12)  # 8 places for 10 + 4 answer tokens: the chosen keeps 4
    assert (cut & ID_BITS).tolist() == [*range(4), *range(10, 14), *range(100, 104)]
    assert np.flatnonzero(cut & BRANCH_START).tolist() == [4, 8]
    assert (truncated_pair(unit, 3) & ID_BITS).tolist() == [0, 1, 2]  # the prompt alone


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "not-shared"])
def test_pairs_pack_whole_into_sequences(tmp_path, shared):
    """A prepared corpus of pairs packs each pair into one sequence, never split between two."""
    from meshtrain.data.chat.records import preference_options_for as options_for
    from meshtrain.data.corpus_cache import tokenised_corpus

    records = [
        {
            "prompt": [{"role": "user", "content": f"{i}+{i}="}],
            "chosen": [{"role": "assistant", "content": str(2 * i)}],
            "rejected": [{"role": "assistant", "content": str(2 * i + 1)}],
        }
        for i in range(12)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = str(FIXTURES / "qwen3")
    chat = options_for(
        tokenizer,
        chat_template=None,
        prompt_key="prompt",
        chosen_key="chosen",
        rejected_key="rejected",
        shared_prompt=shared,
    )
    corpus = tokenised_corpus(
        [path],
        tmp_path,
        tokenizer=tokenizer,
        text_key="text",
        on_bad_record="error",
        directory=tmp_path / "cache",
        verify=True,
        chat=chat,
    )
    assert corpus.num_documents == 12
    packed = PackedConversations(
        [(corpus, np.arange(12))],
        seq_len=127,
        pad_id=0,
        vocab_size=512,
        split="train",
        overlong="error",
        pairs=True,
    )
    rows = [packed[i] for i in range(len(packed))]
    starts = [len(np.flatnonzero(row & DOCUMENT_START)) for row in rows]
    branches = [len(np.flatnonzero(row & BRANCH_START)) for row in rows]
    if shared:  # a pair is one document of two branches
        assert sum(starts) == 12 and branches == [2 * n for n in starts]
    else:  # every pair's two sequences, whole, in one row
        assert sum(starts) == 24 and all(n % 2 == 0 for n in starts) and sum(branches) == 0
    assert (packed.overlong, packed.answers_lost) == (0, 0)
    # Cut: each answer keeps its start; a pair whose cut reaches into the prompt leaves its
    # answers nothing to train (the prompt is never trained).
    unit = corpus.read(0, 0, int(corpus.lengths[0]))
    prompt = 1 + int(np.flatnonzero((unit[1:] & NOT_TRAINED) == 0)[0])  # first answer token
    for width, lost in ((len(unit) - 1, 0), (prompt + 1 if shared else 2 * prompt, 12)):
        cut = PackedConversations(
            [(corpus, np.arange(12))],
            seq_len=width - 1,
            pad_id=0,
            vocab_size=512,
            split="train",
            overlong="truncate",
            pairs=True,
        )
        assert (cut.overlong, cut.answers_lost) == (12, lost)
