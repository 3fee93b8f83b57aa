"""The live comparisons with transformers itself (PyTorch, CPU; the `parity` extra): the
committed fixtures are what transformers computes now; exports load back in transformers with
the same logits, weights and tokenizer; greedy generation picks transformers' tokens; every
published config builds as many parameters in transformers as the fixture says."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_hf
from helpers.paths import HF_CONFIGS
from helpers.tiny_hf import (
    FAMILIES,
    LOGIT_TOLERANCE,
    TOKENS,
    relative_error,
)
from helpers.tiny_tokenizers import train_bpe

import meshtrain
from meshtrain.data import build_tokenizer
from meshtrain.data.tokenizer import ByteTokenizer, save_tokenizer
from meshtrain.hf.save import export_hf
from meshtrain.models.abstract import merge_model
from meshtrain.train.loop import train
from meshtrain.weights.load import load_hf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_torch():
    """helpers.tiny_hf_torch (torch and transformers), imported when a test here runs, not when
    this file is collected: the default (not slow) set collects it too, and must import no torch
    (tests/conftest.py checks). Skipped where the parity extra is not installed."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from helpers import tiny_hf_torch

    return tiny_hf_torch


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: tiny_hf.write_checkpoint(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fixtures_are_what_transformers_computes(family, checkpoints, hf_torch):
    now = hf_torch.reference(family, checkpoints[family])
    committed = tiny_hf.reference(family)
    assert set(now) == set(committed)
    # torch's kernels sum in another order on another CPU (AVX-512 or not): fp32 rounding, a
    # tenth of the relative error meshtrain is allowed against these fixtures (LOGIT_TOLERANCE).
    for name, value in now.items():
        np.testing.assert_allclose(committed[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_through_transformers(family, checkpoints, tmp_path, hf_torch):
    from transformers import AutoTokenizer

    cfg = tiny_hf.run_config(
        family,
        checkpoints[family],
        *tiny_hf.STEP_ONE,
        f"training.micro_batch_size={tiny_hf.STEP_ONE_BATCH}",
    )
    result = train(cfg, tmp_path / "run", devices=jax.devices()[:1])
    tokenizer = train_bpe(tmp_path / "tokenizer", vocab_size=tiny_hf.VOCAB)
    out = export_hf(result.state.params, result.setup.cfg.model, tmp_path / "out", tokenizer)
    reloaded = hf_torch.load(out)
    # The trained weights, bit for bit (fp32 export).
    ours_q = np.asarray(result.state.params["blocks"][1]["attn"]["q"])  # [D, N, H]
    theirs_q = reloaded.state_dict()["model.layers.1.self_attn.q_proj.weight"].numpy()
    np.testing.assert_array_equal(theirs_q, ours_q.transpose(1, 2, 0).reshape(64, 64))
    # The trained model's logits (before export) are transformers' of the export.
    model = merge_model(result.setup.model, result.state.params)
    ours = np.asarray(model(jnp.asarray(TOKENS, jnp.int32)))
    assert relative_error(ours, hf_torch.logits(reloaded, TOKENS)) <= LOGIT_TOLERANCE
    # The tokenizer travels along and transformers reads the same ids and specials.
    text = "def function_3(value)"
    hf_ids = AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False)["input_ids"]
    assert hf_ids == build_tokenizer(str(tokenizer)).encode(text).tolist()
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)


def test_a_bf16_export_in_several_files_loads_in_transformers(checkpoints, tmp_path, hf_torch):
    torch = hf_torch.torch
    directory = checkpoints["gemma3"]
    params = nnx.to_pure_dict(nnx.state(load_hf(directory, scan_layers=True), nnx.Param))
    cfg = tiny_hf.run_config("gemma3", directory, "model.scan_layers=true").model
    out = export_hf(params, cfg, tmp_path / "out", dtype="bfloat16", max_shard_bytes=100_000)
    reloaded = hf_torch.load(out)
    assert reloaded.dtype == torch.bfloat16
    original = hf_torch.load(directory)
    name = "model.layers.6.mlp.down_proj.weight"
    exported = reloaded.state_dict()[name]
    assert torch.equal(exported, original.state_dict()[name].to(torch.bfloat16))
    theirs = hf_torch.logits(reloaded.float(), TOKENS)
    # bf16 weights (8-bit mantissa) move the logits by a few parts in a thousand.
    assert relative_error(tiny_hf.reference("gemma3")["logits"], theirs) < 2e-2


def test_the_byte_tokenizer_export_reads_the_same_ids_in_transformers(tmp_path, hf_torch):
    from transformers import AutoTokenizer

    save_tokenizer(ByteTokenizer(), tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    text = "def f(x):\n    return x  # ü 日本"
    assert hf(text, add_special_tokens=False)["input_ids"] == list(text.encode())
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (257, 258, 256)


def test_greedy_generation_matches_transformers(tmp_path, hf_torch):
    directory = tiny_hf.write_checkpoint("llama", tmp_path / "llama")
    train_bpe(directory, vocab_size=tiny_hf.VOCAB)
    model, tokenizer = meshtrain.load_hf(directory), meshtrain.build_tokenizer(str(directory))
    text = meshtrain.generate(model, tokenizer, tiny_hf.PROMPT, max_new_tokens=tiny_hf.NEW_TOKENS)
    prompt_ids, new_ids = hf_torch.greedy(hf_torch.load(directory))
    assert prompt_ids.tolist() == [tokenizer.bos_id, *tokenizer.encode(tiny_hf.PROMPT).tolist()]
    assert len(new_ids), "transformers generated nothing"
    assert text == tokenizer.decode(new_ids)


def test_parameter_counts_are_what_transformers_builds(hf_torch):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch = hf_torch.torch
    counts = json.loads((tiny_hf.FIXTURES / "parameter_counts.json").read_text())
    for path in sorted(HF_CONFIGS.glob("*.json")):
        config = AutoConfig.for_model(**json.loads(path.read_text()))
        config = getattr(config, "text_config", config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == counts[path.stem], path.stem
