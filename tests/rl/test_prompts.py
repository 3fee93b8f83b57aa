"""The prompts of data=prompts (meshtrain.rl.prompts): strings tokenized with the tokenizer's
specials and stopped at eos, conversations rendered with the chat template's generation prompt
and stopped at the end of the turn too, the other columns kept; each step's prompts follow from
the step alone, each epoch a permutation of all of them."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from helpers.paths import REPO

from meshtrain.data.chat.encoder import build_chat_encoder
from meshtrain.errors import DataError
from meshtrain.rl.prompts import PromptSet, padded_width, read_prompts

GEMMA = str(REPO / "tests" / "fixtures" / "chat" / "gemma3")


def _read(path, **options):
    return read_prompts(
        [str(path)],
        tokenizer=GEMMA,
        chat_template=None,
        prompt_key="prompt",
        on_bad_record=options.get("on_bad_record", "error"),
    )


def test_strings_and_conversations_encode_as_generation_starts_from_them(tmp_path):
    messages = [{"role": "user", "content": "3+4="}]
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"prompt": "3+4=", "answer": "7"})
        + "\n"
        + json.dumps({"prompt": messages, "answer": "7", "level": 1})
        + "\n"
    )
    (text, chat), tokenizer = _read(path)
    encoder = build_chat_encoder(GEMMA)
    expected = encoder.tokenizer.encode_with_offsets("3+4=", add_special_tokens=True)[0]
    np.testing.assert_array_equal(text.ids, expected)
    assert text.stop_ids == (tokenizer.eos_id,) and not text.conversational
    rendered = encoder.render_generation_prompt(messages)
    np.testing.assert_array_equal(chat.ids, rendered.ids)
    assert set(chat.stop_ids) == set(rendered.stop_ids) and len(chat.stop_ids) == 2
    assert chat.prompt == messages and chat.columns == {"answer": "7", "level": 1}


def test_a_record_without_a_prompt_is_a_bad_record(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(DataError) as error:
        _read(path)
    assert str(error.value) == (
        f"{path}:2: no 'prompt' (data.prompt_key) in the record; fix the record, or set "
        "data.on_bad_record=skip (prepare: --on-bad-record skip) to skip it"
    )
    prompts, _ = _read(path, on_bad_record="skip")
    assert len(prompts) == 1


def test_each_step_reads_the_prompts_its_number_gives_and_each_epoch_reads_all(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(10)))
    prompts, _ = _read(path)
    steps = PromptSet(prompts, per_step=4, seed=3)
    first_epochs = [p.prompt for k in range(5) for p in steps.for_step(k)]  # 20: two epochs
    assert Counter(first_epochs[:10]) == Counter(f"{i}+1=" for i in range(10))
    assert Counter(first_epochs[10:]) == Counter(f"{i}+1=" for i in range(10))
    assert first_epochs[:10] != first_epochs[10:]  # each epoch its own order
    again = PromptSet(prompts, per_step=4, seed=3)
    assert [p.prompt for p in again.for_step(3)] == first_epochs[12:16]  # the step alone
    longest = max(p.ids.size for p in prompts)
    width = padded_width(prompts[:2], prompts)  # the longest of every list, rounded up to 8
    assert width % 8 == 0 and longest <= width < longest + 8
    other = PromptSet(prompts, per_step=4, seed=4)
    assert [p.prompt for p in other.for_step(0)] != first_epochs[:4]
