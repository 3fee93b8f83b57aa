"""Malformed chat, prompt/completion and preference records, generated: each one is refused in
one line naming its file and line (data.on_bad_record=error) or skipped and counted (skip),
never a traceback, and the good records around them are read as if the bad ones were absent."""

import json
import random

import pytest
from helpers.paths import REPO

from meshtrain.data.chat.records import chat_options_for, preference_options_for
from meshtrain.data.prepare import prepare
from meshtrain.errors import DataError

TOKENIZER = str(REPO / "tests" / "fixtures" / "chat" / "qwen3" / "tokenizer.json")
COUNT = 120  # malformed records per layout: 240 in all

# Values of the wrong type or shape, and text no record should hold.
ODD_VALUES = [
    None,
    0,
    -1.5,
    True,
    [],
    {},
    [[]],
    {"content": "x"},
    [{"role": "user"}],
    "\ud800",  # a lone surrogate
    "ok\udfffok",
    ["a", 1],
    {"nested": {"deeper": [None]}},
]
ROLES = ["user", "assistant", "system", "bot", "", "USER", 3, None]
TEXTS = ["hi", "", "\u202eright-to-left", "e\u0301", "\x00nul", "\ufeffbom", "🙂" * 3, "\n\t"]


def _message(rng: random.Random) -> object:
    if rng.random() < 0.3:
        return rng.choice(ODD_VALUES)
    message: dict[str, object] = {}
    if rng.random() < 0.85:
        message["role"] = rng.choice(ROLES)
    if rng.random() < 0.85:
        message["content"] = rng.choice(TEXTS + ODD_VALUES)
    if rng.random() < 0.1:
        message["extra"] = rng.choice(ODD_VALUES)
    return message


def _messages(rng: random.Random) -> object:
    if rng.random() < 0.15:
        return rng.choice(ODD_VALUES)
    return [_message(rng) for _ in range(rng.randint(0, 4))]


def _chat(rng: random.Random) -> object:
    shape = rng.randrange(4)
    if shape == 0:
        return {"messages": _messages(rng)}
    if shape == 1:
        return {"prompt": rng.choice(TEXTS + ODD_VALUES), "completion": rng.choice(ODD_VALUES)}
    if shape == 2:  # both layouts, or neither
        return {"messages": _messages(rng), "prompt": "a", "completion": "b"}
    return rng.choice([*ODD_VALUES, {"text": "x"}])


def _pair(rng: random.Random) -> object:
    record: dict[str, object] = {}
    for key in ("prompt", "chosen", "rejected"):
        if rng.random() < 0.9:
            record[key] = rng.choice([_messages(rng), *TEXTS, *ODD_VALUES])
    if rng.random() < 0.1:
        return rng.choice(ODD_VALUES)
    return record


GOOD = {
    "chat": {
        "messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    },
    "preference": {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
}


def _options(layout: str) -> dict:
    if layout == "chat":
        return chat_options_for(
            TOKENIZER,
            chat_template=None,
            train_on="assistant",
            messages_key="messages",
            prompt_key="prompt",
            completion_key="completion",
        )
    return preference_options_for(
        TOKENIZER,
        chat_template=None,
        prompt_key="prompt",
        chosen_key="chosen",
        rejected_key="rejected",
        shared_prompt=True,
    )


class Reader:
    """Prepares one good record followed by a candidate line, each in a file of its own, as
    data=chat or data=preference reads it (the same code tokenises a run's records)."""

    def __init__(self, directory, layout: str):
        self.directory, self.layout, self.options = directory, layout, _options(layout)
        self.files = 0

    def error(self, line: str) -> tuple[str, DataError | None]:
        """(the file written, the DataError of preparing it or None if it is read)."""
        self.files += 1
        path = self.directory / f"{self.files}.jsonl"
        _write(path, [json.dumps(GOOD[self.layout]), line])
        try:
            out = self.directory / f"{self.files}-out"
            prepare([path], out, root=self.directory, tokenizer=TOKENIZER, chat=self.options)
        except DataError as err:
            return str(path), err
        return str(path), None


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    return path


def _malformed(reader: Reader, count: int) -> list[tuple[str, str, DataError]]:
    """`count` distinct lines that meshtrain does not read as a record of the reader's layout,
    with the file each was tried in and its error (seeded: the same every run); a few are not
    JSON objects or not JSON at all. Generated records that happen to be valid are passed over."""
    rng = random.Random(f"{reader.layout}-fuzz")
    make = _chat if reader.layout == "chat" else _pair
    found: dict[str, tuple[str, str, DataError]] = {}
    while len(found) < count:
        if rng.random() < 0.05:
            line = rng.choice(["{", "[1, 2", '{"messages": [}', "nul\x00l", '"just a string"'])
        else:
            line = json.dumps(make(rng))
        if line not in found:
            path, err = reader.error(line)
            if err is not None:
                found[line] = (line, path, err)
    return list(found.values())


@pytest.fixture(scope="module", params=["chat", "preference"])
def malformed(request, tmp_path_factory):
    layout = request.param
    reader = Reader(tmp_path_factory.mktemp(layout), layout)
    return layout, _malformed(reader, COUNT)


def test_every_malformed_record_is_one_line_naming_its_file_and_line(malformed):
    _, records = malformed
    assert len(records) == COUNT
    for _, path, err in records:
        message = str(err)
        assert message.startswith(f"{path}:2: "), message
        assert "\n" not in message and "Traceback" not in message
        assert message.endswith(
            "set data.on_bad_record=skip (prepare: --on-bad-record skip) to skip it"
        ), message


def test_skipped_records_are_counted_and_the_good_ones_read(malformed, tmp_path):
    layout, records = malformed
    options, good = _options(layout), json.dumps(GOOD[layout])
    bad = [line for line, _, _ in records]
    # Every third line a good record: 60 good between the 120 bad.
    body = [good if i % 3 == 0 else bad.pop() for i in range(COUNT + COUNT // 2)]
    mixed = _write(tmp_path / "mixed.jsonl", body)
    corpus = prepare(
        [mixed],
        tmp_path / "out",
        root=tmp_path,
        tokenizer=TOKENIZER,
        chat=options,
        on_bad_record="skip",
    )
    alone = _write(tmp_path / "good.jsonl", [good] * 60)
    reference = prepare(
        [alone], tmp_path / "alone", root=tmp_path, tokenizer=TOKENIZER, chat=options
    )
    assert (corpus.num_documents, corpus.bad_records.total) == (60, COUNT)
    assert corpus.num_tokens == reference.num_tokens
