"""Tokenizers: a Hugging Face tokenizer.json and a sentencepiece .model (trained here), their
special tokens, packing without bos or pad, and a training run on a tokenizer.json."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
import sentencepiece
from helpers.config import compose_config
from helpers.runs import train_tiny
from helpers.tiny_tokenizers import TEXT, train_bpe, train_sentencepiece
from tokenizers import Tokenizer

from meshtrain.data import build_tokenizer
from meshtrain.data.tokenizer import NO_TOKEN
from meshtrain.errors import ConfigError
from meshtrain.train.setup import prepare

SAMPLE = "def function_12(value):\n    return value * 12  # ünïcødé\n"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe"))


def test_tokenizer_json_ids_and_special_tokens(bpe):
    tokenizer = build_tokenizer(str(bpe))
    assert (tokenizer.vocab_size, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (
        300,
        0,
        1,
        2,
    )
    reference = Tokenizer.from_file(str(bpe)).encode(SAMPLE, add_special_tokens=False).ids
    assert tokenizer.encode(SAMPLE).tolist() == reference
    assert tokenizer.encode_bytes(SAMPLE.encode()).tolist() == reference
    assert tokenizer.decode(tokenizer.encode(SAMPLE)) == SAMPLE
    # A Hugging Face checkpoint directory names its tokenizer.json.
    assert build_tokenizer(str(bpe.parent)).encode(SAMPLE).tolist() == reference


def test_tokenizer_config_names_the_special_tokens(tmp_path):
    # Qwen's way: no bos, and a pad that is eos (which counts as no pad at all).
    path = train_bpe(
        tmp_path,
        config={"bos_token": None, "eos_token": {"content": "<eos>"}, "pad_token": "<eos>"},
    )
    tokenizer = build_tokenizer(str(path))
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (NO_TOKEN, 2, NO_TOKEN)
    # Packing without bos and pad: tests/data/test_packing.py.


def test_sentencepiece_model(tmp_path):
    path = train_sentencepiece(tmp_path)
    tokenizer = build_tokenizer(str(path))
    processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    assert (tokenizer.vocab_size, tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id) == (
        200,
        0,
        1,
        2,
    )
    text = "def function_7(value): return value"
    assert tokenizer.encode(text).tolist() == processor.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"is a directory without tokenizer\.json or tokenizer"):
        build_tokenizer(str(tmp_path))
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(ValueError, match=r"unknown tokenizer file type '\.txt'"):
        build_tokenizer(str(tmp_path / "vocab.txt"))
    path = train_bpe(tmp_path / "no_eos", config={"eos_token": None})
    with pytest.raises(ValueError, match="has no end-of-sequence token; name it as eos_token"):
        build_tokenizer(str(path))


def _corpus(directory):
    directory.mkdir()
    for i, doc in enumerate(TEXT.split("\n\n")[:40]):
        (directory / f"doc{i:02d}.txt").write_text(doc)
    return directory


@pytest.mark.slow
def test_training_on_a_tokenizer_json(bpe, tmp_path, run_dir):
    corpus = _corpus(tmp_path / "corpus")
    result = train_tiny(
        run_dir,
        f"data.path={corpus}",
        "data.glob=*.txt",
        f"data.tokenizer={bpe}",
        "data.seq_len=32",
        "data.validation_fraction=0.0",
        "training.steps=2",
        "training.warmup_steps=1",
        "training.eval_every=0",
        "training.micro_batch_size=2",
        devices=1,
    )
    data = result.setup.train_data
    tokenizer = build_tokenizer(str(bpe))
    docs = sorted(corpus.glob("*.txt"))
    # Every document is bos + its tokens + eos, and only the last window is padded.
    expected = sum(len(tokenizer.encode(d.read_text())) + 2 for d in docs)
    assert (data.vocab_size, data.pad_id, data.num_tokens) == (300, 0, expected)
    assert len(data) == math.ceil(expected / 33)
    # Untrained, the model is near uniform over its 384 embedding rows.
    assert abs(result.history[0]["loss"] - math.log(384)) < 0.1


def test_the_model_vocabulary_must_hold_the_tokenizer(bpe, tmp_path):
    cfg = compose_config(
        f"data.path={_corpus(tmp_path / 'corpus')}",
        "data.glob=*.txt",
        f"data.tokenizer={bpe}",
        "model.vocab_size=256",
    )
    with pytest.raises(ConfigError) as err:
        prepare(cfg, jax.devices()[:1])
    assert str(err.value) == (
        f"model.vocab_size=256 is smaller than the vocabulary of data.tokenizer='{bpe}' (300); "
        "raise model.vocab_size"
    )


@pytest.mark.parametrize("kind", ["byte", "bpe", "sentencepiece"])
def test_encode_batch_equals_one_encode_per_text(kind, tmp_path):
    name = {
        "byte": lambda: "byte",
        "bpe": lambda: str(train_bpe(tmp_path)),
        "sentencepiece": lambda: str(train_sentencepiece(tmp_path)),
    }[kind]()
    tokenizer = build_tokenizer(name)
    texts = ["def function_1(value):", "", "ünïcödé text", TEXT[:300]]
    batch = tokenizer.encode_batch(texts)
    assert [b.dtype for b in batch] == [np.int32] * 4
    assert [b.tolist() for b in batch] == [tokenizer.encode(t).tolist() for t in texts]
    assert len(batch[0]) > 0 and len(batch[1]) == 0
