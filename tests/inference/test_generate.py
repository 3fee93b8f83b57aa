"""Generation: greedy decoding picks the tokens transformers' own greedy generate picks (its
committed ids, helpers.tiny_hf; tests/hf/test_interop_live.py, slow, runs transformers itself),
on one device and sharded; a generation is two compiled programs (prefill, decode step);
sampling is seeded; `python -m meshtrain.generate` prints the prompt and its continuation."""

from __future__ import annotations

import logging

import jax
import pytest
from flax import nnx
from helpers import tiny_hf
from helpers.commands import module_command
from helpers.meshes import on_mesh
from helpers.tiny_tokenizers import train_bpe

import meshtrain
from meshtrain.config import ModelConfig
from meshtrain.data.tokenizer import ByteTokenizer
from meshtrain.inference.generate import prompt_bucket
from meshtrain.models.transformer import Transformer

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


def test_greedy_generation_on_a_mesh_matches_transformers(checkpoint, loaded):
    _, tokenizer = loaded
    model = meshtrain.load_hf(checkpoint, [[4, 2], ["fsdp", "tp"]])  # 2 key/value heads on tp=2
    text = meshtrain.generate(model, tokenizer, PROMPT, max_new_tokens=tiny_hf.NEW_TOKENS)
    assert text == tokenizer.decode(tiny_hf.reference("llama")["greedy_ids"].tolist())


class ShowIds(ByteTokenizer):
    """The byte tokenizer, decoding to the ids themselves: "104 105"."""

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def test_one_kv_head_on_a_mesh_generates_what_one_device_does():
    """tp=2 ranks share the one key/value head: its projections and cache are replicated."""
    cfg = ModelConfig(num_heads=4, num_kv_heads=1, head_dim=32, init_std=0.2)
    alone = Transformer(cfg, rngs=nnx.Rngs(0))
    sharded = on_mesh(alone, cfg, [[4, 2], ["fsdp", "tp"]])
    tokenizer = ShowIds()
    want = meshtrain.generate(alone, tokenizer, "def f(x):", max_new_tokens=16)
    assert len(want.split()) == 16  # no eos before the last token
    assert meshtrain.generate(sharded, tokenizer, "def f(x):", max_new_tokens=16) == want


# Sampled generations of 8 tokens: compiled first by test_a_generation_is_two_compiled_programs
# (which needs programs not compiled before), then run by test_sampling_depends_on_the_seed_only.
SAMPLED = dict(max_new_tokens=8, temperature=1.0)


def test_a_generation_is_two_compiled_programs(loaded, caplog):
    """One prefill and one decode step, whatever the number of tokens; a prompt of another
    length in the same bucket compiles nothing."""
    model, tokenizer = loaded
    other = PROMPT + " return"
    lengths = [len(tokenizer.encode(p)) + 1 for p in (PROMPT, other)]  # bos + the prompt
    assert lengths[0] != lengths[1] and prompt_bucket(lengths[0]) == prompt_bucket(lengths[1])
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        meshtrain.generate(model, tokenizer, PROMPT, **SAMPLED, seed=3)
        compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
        meshtrain.generate(model, tokenizer, other, **SAMPLED, seed=3)
    assert len(compiled) == 2, compiled
    assert "_prefill" in compiled[0] and "_decode" in compiled[1], compiled
    again = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert again == compiled


def test_prompts_are_padded_to_power_of_two_buckets():
    assert [prompt_bucket(n) for n in (1, 16, 17, 100, 256, 257)] == [16, 16, 32, 128, 256, 512]


def test_sampling_depends_on_the_seed_only(loaded):
    model, tokenizer = loaded
    first = meshtrain.generate(model, tokenizer, PROMPT, **SAMPLED, seed=1)
    again = meshtrain.generate(model, tokenizer, PROMPT, **SAMPLED, seed=1)
    other = meshtrain.generate(model, tokenizer, PROMPT, **SAMPLED, seed=2)
    assert first == again != other


def _cli(*args):
    return module_command("meshtrain.generate", args, devices=1)


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
