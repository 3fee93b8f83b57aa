"""Generation: greedy decoding picks the tokens transformers' own greedy generate picks (its
committed ids, helpers.tiny_hf; tests/hf/test_interop_live.py, slow, runs transformers itself),
on one device and sharded; a batch of prompts generates what each prompt does alone, each row
stopping at its own stop id; a generation is one compiled program; sampling is seeded, draws
from the model's softmax at its temperature (a chi-square test) and never outside top-k/top-p;
`python -m meshtrain.generate` prints the prompt and its continuation."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_hf
from helpers.commands import module_command
from helpers.meshes import on_mesh
from helpers.tiny_tokenizers import train_bpe
from scipy import stats

import meshtrain
from meshtrain.config import ModelConfig
from meshtrain.data.tokenizer import ByteTokenizer
from meshtrain.inference.decoding import Decoding, prompt_bucket
from meshtrain.inference.generate import generate_ids, generate_ids_batch
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


@pytest.mark.slow
def test_one_kv_head_on_a_mesh_generates_what_one_device_does():
    """tp=2 ranks share the one key/value head: its projections and cache are replicated."""
    cfg = ModelConfig(num_heads=4, num_kv_heads=1, head_dim=32, init_std=0.2)
    alone = Transformer(cfg, rngs=nnx.Rngs(0))
    sharded = on_mesh(alone, cfg, [[4, 2], ["fsdp", "tp"]])
    tokenizer = ShowIds()
    want = meshtrain.generate(alone, tokenizer, "def f(x):", max_new_tokens=16)
    assert len(want.split()) == 16  # no eos before the last token
    assert meshtrain.generate(sharded, tokenizer, "def f(x):", max_new_tokens=16) == want


@pytest.mark.parametrize("mesh", [None, [[4, 2], ["fsdp", "tp"]]])
@pytest.mark.slow
def test_a_batch_of_prompts_generates_what_each_prompt_does_alone(mesh):
    """Prompts of 3 to 20 tokens (two buckets) left-padded into one batch, rows sharded over
    fsdp on the mesh; each row stops at its own stop id and is padded after it."""
    cfg = ModelConfig(num_heads=4, num_kv_heads=2, head_dim=32, init_std=0.2)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if mesh is not None:
        model = on_mesh(model, cfg, mesh)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (3, 20, 9, 14)]
    free = [generate_ids(model, p, 12) for p in prompts]
    stop = int(free[0][4])  # row 0 stops at its 5th token; others where (if) they pick it
    alone = [generate_ids(model, p, 12, stop_ids=[stop]) for p in prompts]
    assert alone[0].tolist() == free[0][:5].tolist()
    assert [len(ids) for ids in alone] != [12] * 4
    together = generate_ids_batch(model, prompts, 12, stop_ids=[stop])
    assert [ids.tolist() for ids in together] == [ids.tolist() for ids in alone]


def _first_token_draws(model, prompt, draws: int, **sampling) -> np.ndarray:
    """The first token picked after `prompt`, in a batch of `draws` copies of it: [draws]."""
    picked = generate_ids_batch(model, [prompt] * draws, 1, seed=5, **sampling)
    return np.array([int(ids[0]) for ids in picked])


def _fits(draws: np.ndarray, probabilities: np.ndarray) -> float:
    """The chi-square p-value of the draws' counts against `probabilities` [V] (tokens expected
    fewer than 5 times pooled into one bin, if any has a chance)."""
    counts = np.bincount(draws, minlength=probabilities.size)
    expected = probabilities * draws.size
    big = expected >= 5
    observed, expected = counts[big], expected[big]
    if probabilities[~big].sum() > 0:
        observed = np.append(observed, counts[~big].sum())
        expected = np.append(expected, probabilities[~big].sum() * draws.size)
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


def _softmax(logits: np.ndarray) -> np.ndarray:
    exp = np.exp(logits - logits.max())
    return exp / exp.sum()


@pytest.mark.slow
def test_sampling_draws_from_the_softmax_and_top_k_top_p_keep_their_sets():
    """4,096 draws of one token: at temperature 0.5 their counts fit softmax(logits / 0.5)
    (chi-square p > 0.001; softmax(logits) is refused); with top-k 6 or top-p 0.9 every
    draw is in the kept set and the counts fit the set's renormalised probabilities."""
    cfg = ModelConfig(num_heads=4, num_kv_heads=2, head_dim=32, init_std=0.2)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    prompt = np.array([104, 101, 108, 108, 111], np.int32)
    logits = np.asarray(model(prompt[None]), np.float64)[0, -1]  # [V]
    probabilities = _softmax(logits / 0.5)
    draws = _first_token_draws(model, prompt, 4096, temperature=0.5)
    assert _fits(draws, probabilities) > 1e-3
    assert _fits(draws, _softmax(logits)) < 1e-6  # the softmax at temperature 1 is refused
    ranked = np.argsort(-probabilities)
    top_k = np.zeros_like(probabilities)
    top_k[ranked[:6]] = probabilities[ranked[:6]]
    draws = _first_token_draws(model, prompt, 4096, temperature=0.5, top_k=6)
    assert set(draws.tolist()) <= set(ranked[:6].tolist())
    assert _fits(draws, top_k / top_k.sum()) > 1e-3
    before = np.cumsum(probabilities[ranked]) - probabilities[ranked]
    nucleus = ranked[before < 0.9]  # the fewest most likely tokens with 0.9 of the mass
    top_p = np.zeros_like(probabilities)
    top_p[nucleus] = probabilities[nucleus]
    draws = _first_token_draws(model, prompt, 4096, temperature=0.5, top_p=0.9)
    assert set(draws.tolist()) <= set(nucleus.tolist()) and len(nucleus) > 1
    assert _fits(draws, top_p / top_p.sum()) > 1e-3


# Sampled generations of 8 tokens: compiled first by test_a_generation_is_one_compiled_program
# (which needs programs not compiled before), then run by test_sampling_depends_on_the_seed_only.
SAMPLED = dict(max_new_tokens=8, temperature=1.0)


def test_a_generation_is_one_compiled_program(loaded, caplog):
    """The prefill and the decode loop in one program, whatever the number of tokens; a prompt
    of another length in the same bucket compiles nothing."""
    model, tokenizer = loaded
    other = PROMPT + " return"
    lengths = [len(tokenizer.encode(p)) + 1 for p in (PROMPT, other)]  # bos + the prompt
    assert lengths[0] != lengths[1] and prompt_bucket(lengths[0]) == prompt_bucket(lengths[1])
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        meshtrain.generate(model, tokenizer, PROMPT, **SAMPLED, seed=3)
        compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
        meshtrain.generate(model, tokenizer, other, **SAMPLED, seed=3)
    assert len(compiled) == 1 and "generate_batch_program" in compiled[0], compiled
    again = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert again == compiled


def test_prompts_are_padded_to_power_of_two_buckets():
    assert [prompt_bucket(n) for n in (1, 16, 17, 100, 256, 257)] == [16, 16, 32, 128, 256, 512]


@pytest.mark.slow
def test_a_fixed_width_pads_every_prompt_to_it_and_generates_the_same(loaded):
    """`bucket` (a policy-gradient run's prompts' width) instead of the power of two: the same
    greedy ids; narrower than the longest prompt is refused."""
    model, tokenizer = loaded
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode(PROMPT + " return")]
    longest = max(len(ids) for ids in prompts)
    fixed = generate_ids_batch(model, prompts, 8, bucket=longest + 3)
    for ours, theirs in zip(fixed, generate_ids_batch(model, prompts, 8), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(ValueError, match=rf"^bucket={longest - 1} is shorter than the longest"):
        generate_ids_batch(model, prompts, 8, bucket=longest - 1)


def test_a_decoding_in_stretches_picks_generate_ids_batchs_ids_and_stops_rows(loaded):
    """Decoding (the harness's generation): stretches of 3 steps pick the ids of one
    generate_ids_batch, sampled alike from the same seed; a row the caller stops picks nothing
    more (0) while the others go on; every row done ends it before max_new_tokens."""
    model, tokenizer = loaded
    prompts = [tokenizer.encode(p) for p in (PROMPT, "import json", PROMPT + " return")]
    whole = generate_ids_batch(model, prompts, 8, temperature=1.0, seed=5)
    decoding = Decoding(model, prompts, 8, temperature=1.0, seed=5)
    assert decoding.steps == 1 and not decoding.finished
    picked = decoding.advance(3)
    assert picked.shape == (3, 4) and decoding.steps == 4
    picked = decoding.advance(3, stopped=np.array([False, True, False]))
    assert picked.shape == (3, 7) and decoding.done.tolist() == [False, True, False]
    picked = decoding.advance(3)
    assert picked.shape == (3, 8) and decoding.finished
    for row in (0, 2):
        np.testing.assert_array_equal(picked[row], whole[row])
    np.testing.assert_array_equal(picked[1, :4], whole[1][:4])
    assert picked[1, 4:].tolist() == [0, 0, 0, 0]  # stopped after its 4th id
    # A row that picks a stop id is done; all done, the decoding is finished early.
    first = generate_ids_batch(model, prompts, 1)
    stop_ids = {int(ids[0]) for ids in first}
    decoding = Decoding(model, prompts, 8, stop_ids=stop_ids)
    picked = decoding.advance(4)
    assert decoding.finished and decoding.steps == 1 and decoding.done.all()
    assert picked[:, 0].tolist() == [int(ids[0]) for ids in first]


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
