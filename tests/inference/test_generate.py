"""Generation: greedy decoding picks the tokens transformers' own greedy generate picks (its
committed ids, helpers.tiny_hf; tests/hf/test_interop_live.py, slow, runs transformers itself);
sampling is seeded; `python -m meshtrain.generate` prints the prompt and its continuation."""

from __future__ import annotations

import pytest
from helpers import tiny_hf
from helpers.process import run_python
from helpers.tiny_tokenizers import train_bpe

import meshtrain

PROMPT = tiny_hf.PROMPT


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny HF Llama with a BPE tokenizer of at most 512 tokens in the same directory."""
    directory = tiny_hf.write_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    train_bpe(directory, vocab_size=tiny_hf.VOCAB)
    return directory


@pytest.fixture(scope="module")
def loaded(checkpoint):
    directory = checkpoint
    return meshtrain.load_hf(directory), meshtrain.build_tokenizer(str(directory))


def test_greedy_generation_matches_transformers(loaded):
    model, tokenizer = loaded
    theirs = tiny_hf.reference("llama")  # generate(do_sample=False) on the same checkpoint
    text = meshtrain.generate(model, tokenizer, PROMPT, max_new_tokens=tiny_hf.NEW_TOKENS)
    ids = [tokenizer.bos_id, *tokenizer.encode(PROMPT).tolist()]
    assert ids == theirs["prompt_ids"].tolist()  # the prompt transformers was given
    new_ids = theirs["greedy_ids"].tolist()
    assert new_ids, "transformers generated nothing"
    assert text == tokenizer.decode(new_ids)


def test_sampling_depends_on_the_seed_only(loaded):
    model, tokenizer = loaded
    first = meshtrain.generate(model, tokenizer, PROMPT, 8, temperature=1.0, seed=1)
    again = meshtrain.generate(model, tokenizer, PROMPT, 8, temperature=1.0, seed=1)
    other = meshtrain.generate(model, tokenizer, PROMPT, 8, temperature=1.0, seed=2)
    assert first == again != other


def _cli(*args):
    return run_python("-m", "meshtrain.generate", *args, devices=1, timeout=300)


def test_command_line(checkpoint, loaded):
    directory = checkpoint
    model, tokenizer = loaded
    result = _cli(directory, PROMPT, "--max-new-tokens", 12)
    assert result.returncode == 0, result.stderr
    expected = PROMPT + meshtrain.generate(model, tokenizer, PROMPT, max_new_tokens=12)
    assert result.stdout == expected + "\n"
    missing = _cli(directory / "missing", PROMPT)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"meshtrain: error: {directory / 'missing'} is not a directory; pass a meshtrain "
        "checkpoint (or its run directory) or a Hugging Face checkpoint directory "
        "(config.json, *.safetensors)"
    ]
