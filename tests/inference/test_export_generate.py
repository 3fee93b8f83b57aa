"""Export, then generate: every export format of a byte-tokenized run carries its tokenizer, and
`python -m meshtrain.generate <export>` continues a prompt exactly as on the run itself."""

import numpy as np
import pytest
from helpers.runs import SMALL_RUN, train_tiny

from meshtrain.cli.generate import main as generate_main
from meshtrain.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer, save_tokenizer
from meshtrain.errors import ConfigError
from meshtrain.inference.export import EXPORTERS, export
from meshtrain.weights import load
from meshtrain.weights.load import load_checkpoint, load_model, load_tokenizer

PROMPT = "import "
TEXTS = ("def f(x):\n    return x  # ü 日本 🙂", "\x00\x01\x7f tabs\there", "")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """3 steps of the one-layer tiny model (helpers.runs.SMALL_RUN: synthetic data, byte
    tokenizer) on one device, with a checkpoint at the end."""
    directory = tmp_path_factory.mktemp("run")
    train_tiny(directory, *SMALL_RUN, devices=1)
    return directory


@pytest.fixture(scope="module")
def exports(run_dir, tmp_path_factory):
    """format → the run exported in it."""
    root = tmp_path_factory.mktemp("exports")
    for fmt in EXPORTERS:
        export(run_dir, root / fmt, fmt)
    return {fmt: root / fmt for fmt in EXPORTERS}


def test_the_byte_tokenizer_as_tokenizer_json_gives_the_same_ids(tmp_path):
    save_tokenizer(ByteTokenizer(), tmp_path)
    saved = build_tokenizer(str(tmp_path))
    assert isinstance(saved, HFTokenizer)
    assert (saved.vocab_size, saved.pad_id, saved.bos_id, saved.eos_id) == (259, 256, 257, 258)
    byte = ByteTokenizer()
    for text in TEXTS:
        ids = saved.encode(text)
        np.testing.assert_array_equal(ids, byte.encode(text))
        assert saved.decode([257, *ids, 258]) == text == byte.decode([257, *ids, 258])


@pytest.mark.parametrize("fmt", list(EXPORTERS))
def test_every_export_loads_the_same_model_and_tokenizer(run_dir, exports, fmt):
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12) + 97  # [B=2, T=12]
    want = np.asarray(load_checkpoint(run_dir)(tokens))
    np.testing.assert_allclose(np.asarray(load_model(exports[fmt])(tokens)), want, rtol=1e-6)
    np.testing.assert_array_equal(
        load_tokenizer(exports[fmt]).encode(TEXTS[0]), list(TEXTS[0].encode())
    )


def test_generate_on_each_export_continues_as_on_the_run(run_dir, exports, capsys):
    argv = [PROMPT, "--max-new-tokens", "6"]
    assert generate_main([str(run_dir), *argv]) == 0
    on_the_run = capsys.readouterr().out
    assert on_the_run.startswith(PROMPT) and len(on_the_run) > len(PROMPT) + 1
    for fmt, directory in exports.items():
        assert generate_main([str(directory), *argv]) == 0, fmt
        assert capsys.readouterr().out == on_the_run, fmt


def test_a_run_whose_tokenizer_moved_falls_back_to_the_exports_copy(run_dir, exports, monkeypatch):
    recorded = {"config": {"data": {"tokenizer": "moved/tokenizer.json"}}}  # no identity kept
    monkeypatch.setattr(load, "checkpoint_meta", lambda path: recorded)
    assert load_tokenizer(exports["orbax"]).eos_id == 258  # the copy the export carries
    with pytest.raises(ConfigError) as raised:
        load_tokenizer(run_dir)
    message = str(raised.value)
    assert "was trained with data.tokenizer='moved/tokenizer.json', which is not found" in message
    assert "--tokenizer byte" in message and "\n" not in message
    # meshtrain-eval has no --tokenizer: its model_args name it.
    with pytest.raises(ConfigError) as raised:
        load_tokenizer(run_dir, option="--model_args tokenizer=")
    assert str(raised.value).endswith(
        "pass the tokenizer the model was trained with: --model_args tokenizer=byte, "
        "--model_args tokenizer=PATH/tokenizer.json (or .model), or --model_args "
        "tokenizer=DIRECTORY holding one"
    )


def test_a_directory_without_a_tokenizer_asks_for_one(exports, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((exports["hf"] / name).read_bytes())
    with pytest.raises(SystemExit) as exited:
        generate_main([str(bare), PROMPT])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0
    assert f"{bare} holds no tokenizer.json or tokenizer.model" in error
    assert "--tokenizer byte" in error and "--tokenizer=" not in error
    # As many new tokens as test_generate_on_each_export_continues_as_on_the_run: its programs.
    assert generate_main([str(bare), PROMPT, "--tokenizer", "byte", "--max-new-tokens", "6"]) == 0
