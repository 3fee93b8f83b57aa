"""Chat data from records to packed, marked sequences: whole conversations per window, the
trained tokens exactly the assistant turns, overlong conversations counted, bad records named."""

import json

import numpy as np
import pytest
from helpers.config import compose_config
from helpers.paths import REPO

from meshtrain.cli.prepare import main as prepare_main
from meshtrain.config.data import TrainOn
from meshtrain.config.schema import choices
from meshtrain.data import build_dataset
from meshtrain.data.chat.encoder import build_chat_encoder
from meshtrain.data.chat.marks import DOCUMENT_START, ID_BITS, NOT_TRAINED
from meshtrain.data.chat.packing import first_fit_windows, greedy_windows, packed_windows
from meshtrain.data.chat.records import TRAIN_ON
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import DataError

GEMMA = REPO / "tests" / "fixtures" / "chat" / "gemma3" / "tokenizer.json"


def _conversation(i):
    messages = [
        {"role": "user", "content": f"{i}+{i}="},
        {"role": "assistant", "content": str(2 * i)},
    ]
    return {"messages": ([{"role": "system", "content": "Add."}] if i % 2 else []) + messages}


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "train.jsonl"
    path.write_text("".join(json.dumps(_conversation(i)) + "\n" for i in range(40)))
    return path


def _dataset(path, *overrides, split="train"):
    cfg = compose_config(
        "data=chat",
        f"data.paths=[{path}]",
        f"data.tokenizer={GEMMA}",
        "model.vocab_size=512",
        "data.cache_dir=null",
        "data.validation_fraction=0",
        *overrides,
    )
    return build_dataset(cfg.data, split=split, vocab_size=512)


def test_greedy_windows_hold_whole_conversations():
    assert greedy_windows(np.array([3, 4, 2, 5, 5, 1]), 8).tolist() == [0, 2, 4, 6]
    assert greedy_windows(np.array([8, 8]), 8).tolist() == [0, 1, 2]
    assert greedy_windows(np.array([], np.int64), 8).tolist() == [0]


def test_first_fit_fills_the_gaps_of_the_last_open_windows_in_data_order():
    lengths = np.array([5, 6, 3, 2, 8, 1, 4])
    # 5 opens window 0, 6 window 1, 3 fills 0, 2 fills 1, 8 opens 2, 1 opens 3, 4 joins 3.
    assert first_fit_windows(lengths, 8).tolist() == [0, 1, 0, 1, 2, 3, 3]
    order, firsts = packed_windows(lengths, 8, "first_fit")
    assert order.tolist() == [0, 2, 1, 3, 4, 5, 6] and firsts.tolist() == [0, 2, 4, 5, 7]
    assert greedy_windows(lengths, 8).tolist() == [0, 1, 2, 4, 5, 7]  # in_order: 5 windows
    # Only the OPEN_WINDOWS (8) most recently opened windows take a conversation: after 7
    # windows more, the first one's gap of 1 is still open; after 8, it is closed.
    assert first_fit_windows(np.array([7] + [8] * 7 + [1]), 8).tolist()[-1] == 0
    assert first_fit_windows(np.array([7] + [8] * 8 + [1]), 8).tolist()[-1] == 9


@pytest.mark.parametrize("packing", ["first_fit", "in_order"])
def test_windows_carry_whole_conversations_and_exactly_the_assistant_tokens(chats, packing):
    train = _dataset(chats, "data.seq_len=63", f"data.packing={packing}")
    encoder = build_chat_encoder(str(GEMMA))
    tokenizer = build_tokenizer(str(GEMMA))
    expected = [encoder.encode(_conversation(i)) for i in range(40)]
    lengths = np.array([len(e.ids) for e in expected])
    order, firsts = packed_windows(lengths, 64, packing)
    assert train.num_documents == 40 and len(train) == len(firsts) - 1
    if packing == "first_fit":  # fewer windows than filling one at a time
        assert len(train) == 19 < len(greedy_windows(lengths, 64)) - 1 == 20
    conversation = 0
    for index in range(len(train)):
        window = train[index]  # int32 [64]
        starts = np.flatnonzero(window & DOCUMENT_START)
        for start in starts:
            e = expected[order[conversation]]
            piece = window[start : start + len(e.ids)]
            np.testing.assert_array_equal(piece & ID_BITS, e.ids)
            np.testing.assert_array_equal((piece & NOT_TRAINED) == 0, e.trained)
            conversation += 1
        end = starts[-1] + len(expected[order[conversation - 1]].ids)
        assert np.all(window[end:] & NOT_TRAINED)  # padding: never trained
    assert conversation == 40 and sorted(order.tolist()) == list(range(40))
    # The trained tokens of conversation 1 are its answer and the end-of-turn token.
    trained = expected[1].ids[expected[1].trained]
    assert tokenizer.decode(trained) == "2" and len(trained) == 2
    assert (trained[-1:] == tokenizer.encode("<end_of_turn>")).all()


@pytest.mark.parametrize(
    ("overlong", "windows", "message"),
    [("truncate", 40, None), ("drop", 20, None), ("error", None, "20 train conversations")],
)
def test_overlong_conversations_are_cut_dropped_or_refused(chats, overlong, windows, message):
    # seq_len 21: the 20 conversations with a system turn (odd i, 23-26 tokens) are longer
    # than a window of 22; the others (18-21 tokens) fit, one per window.
    if message:
        with pytest.raises(DataError) as err:
            _dataset(chats, "data.seq_len=21", f"data.overlong={overlong}")
        assert str(err.value).startswith(
            "20 train conversations are longer than data.seq_len + 1 = 22 tokens (the longest: "
            "26); raise data.seq_len"
        )
        assert str(err.value).endswith(
            "raise data.seq_len, or set data.overlong=truncate or data.overlong=drop"
        )
        return
    train = _dataset(chats, "data.seq_len=21", f"data.overlong={overlong}")
    assert train.overlong == 20 and len(train) == windows


@pytest.mark.parametrize(("seq_len", "cut", "lost"), [(19, 35, 20), (21, 20, 15), (23, 15, 0)])
def test_answers_lost_to_truncation_are_counted(chats, seq_len, cut, lost, caplog):
    # A cut conversation keeps its first seq_len + 1 tokens; it teaches nothing when no trained
    # token (the answer, the end of turn) is among them after the first.
    encoder = build_chat_encoder(str(GEMMA))
    expected = [encoder.encode(_conversation(i)) for i in range(40)]
    width = seq_len + 1
    longer = [e for e in expected if len(e.ids) > width]
    assert (len(longer), sum(not e.trained[1:width].any() for e in longer)) == (cut, lost)
    caplog.set_level("INFO", logger="meshtrain")
    train = _dataset(chats, f"data.seq_len={seq_len}")
    assert (train.overlong, train.answers_lost) == (cut, lost)
    tail = f"; {lost} of them lost every answer token to the cut and train nothing"
    line = (
        f"data: {cut} of 40 train conversations truncated to data.seq_len + 1 = {width} "
        f"tokens (data.overlong=truncate){tail if lost else ''}"
    )
    assert line in caplog.messages


def test_a_bad_record_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    rows = [_conversation(0), {"messages": [{"role": "bot", "content": "hi"}]}, {"text": "x"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as err:
        _dataset(path)
    assert str(err.value) == (
        f"{path}:2: messages[0] has role 'bot'; the roles are system, user, assistant; fix the "
        "record, or set data.on_bad_record=skip (prepare: --on-bad-record skip) to skip it"
    )
    train = _dataset(path, "data.on_bad_record=skip")
    assert train.num_documents == 1


def test_chat_data_needs_records_and_a_template(tmp_path):
    (tmp_path / "doc.txt").write_text("plain text")
    with pytest.raises(DataError) as err:
        _dataset(tmp_path / "doc.txt")
    assert str(err.value) == (
        f"{tmp_path / 'doc.txt'}: chat data are records in .jsonl, .jsonl.gz or .parquet "
        "files, not a text file; convert it, or leave it out of data.paths"
    )


def test_prepared_conversations_train_as_the_cached_ones(chats, tmp_path):
    out = tmp_path / "prepared"
    prepare_main(["--out", str(out), "--tokenizer", str(GEMMA), "--chat", str(chats)])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["chat"]["train_on"] is None and manifest["token_dtype"] == "uint32"
    prepared, cached = _dataset(out), _dataset(chats)
    assert len(prepared) == len(cached)
    for i in range(len(cached)):
        np.testing.assert_array_equal(prepared[i], cached[i])
    with pytest.raises(DataError, match=r"was prepared with other chat options \(train_on: None\)"):
        _dataset(out, "data.train_on=all")
    text = tmp_path / "text"
    (tmp_path / "doc.txt").write_text("plain text")
    prepare_main(["--out", str(text), "--tokenizer", str(GEMMA), str(tmp_path / "doc.txt")])
    with pytest.raises(DataError, match="holds prepared documents, which data=chat cannot"):
        _dataset(text)


def test_the_prepare_command_knows_the_train_on_choices():
    assert choices(TrainOn) == TRAIN_ON
