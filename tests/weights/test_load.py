"""load_checkpoint and `python -m meshtrain.generate` on a meshtrain checkpoint: the trained
parameters, on one device or sharded, and the tokenizer the run was trained with."""

import logging

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_hf
from helpers.commands import module_command
from helpers.runs import SMALL_RUN, train_tiny

import meshtrain
from meshtrain.checkpoint.layout import fingerprints
from meshtrain.errors import ConfigError
from meshtrain.models.abstract import merge_model
from meshtrain.weights.load import checkpoint_config, load_checkpoint

PROMPT = "import "


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 steps of the one-layer tiny model (helpers.runs.SMALL_RUN: synthetic data, byte
    tokenizer) on [[4,2]] with a checkpoint after each."""
    run_dir = tmp_path_factory.mktemp("run")
    return run_dir, train_tiny(
        run_dir, *SMALL_RUN, "model.mesh_shape=[[4,2],[fsdp,tp]]", "checkpoint.every_steps=1"
    )


def _nnx_params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.slow
def test_loads_the_newest_checkpoint_onto_one_device_or_a_mesh(trained):
    run_dir, result = trained
    alone = load_checkpoint(run_dir)
    assert fingerprints(_nnx_params(alone)) == fingerprints(result.state.params)
    assert {len(leaf.sharding.device_set) for leaf in jax.tree.leaves(_nnx_params(alone))} == {1}
    step_2 = load_checkpoint(run_dir / "checkpoints" / "2", [[8, 1], ["fsdp", "tp"]])
    assert fingerprints(_nnx_params(step_2)) != fingerprints(result.state.params)
    embed = _nnx_params(step_2)["embed"]  # [vocab, embed], embed on fsdp
    assert embed.addressable_shards[0].data.shape == (embed.shape[0], embed.shape[1] // 8)

    tokens = np.arange(32, dtype=np.int32).reshape(2, 16) + 40  # [B=2, T=16]
    trained_model = merge_model(result.setup.model, result.state.params)
    sharded = load_checkpoint(run_dir, [[4, 2], ["fsdp", "tp"]])
    want = np.asarray(trained_model(tokens))
    np.testing.assert_array_equal(np.asarray(sharded(tokens)), want)  # the same mesh and arrays
    # One device sums in another order: fp32 rounding only.
    np.testing.assert_allclose(np.asarray(alone(tokens)), want, rtol=1e-5, atol=1e-5)


def test_a_call_is_one_compiled_program_per_input_shape(trained, caplog):
    """Not op by op: the loaded model's call compiles once per shape, then reuses it."""
    run_dir, _ = trained
    model = load_checkpoint(run_dir, [[4, 2], ["fsdp", "tp"]])
    short = np.arange(24, dtype=np.int32).reshape(2, 12)  # [B=2, T=12]
    long = np.arange(40, dtype=np.int32).reshape(2, 20)  # [B=2, T=20]
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        first = np.asarray(model(short))
        again = np.asarray(model(short))
        model(long)
    compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert len(compiled) == 2 and all("_compiled_call" in m for m in compiled), compiled
    np.testing.assert_array_equal(first, again)


def test_config_and_errors(trained, tmp_path):
    run_dir, _ = trained
    assert checkpoint_config(run_dir)["data"]["tokenizer"] == "byte"
    with pytest.raises(ConfigError, match="holds no complete meshtrain checkpoint"):
        load_checkpoint(tmp_path)


def test_generate_command_on_a_run_directory(trained):
    run_dir, _ = trained
    # 6 new tokens, as tests/inference/test_export_generate.py generates with the same
    # one-layer model: a test run compiles its generation programs once.
    result = module_command(
        "meshtrain.generate", [run_dir, PROMPT, "--max-new-tokens", "6"], devices=1
    )
    assert result.returncode == 0, result.stderr
    model, tokenizer = load_checkpoint(run_dir), meshtrain.build_tokenizer("byte")
    completion = meshtrain.generate(model, tokenizer, PROMPT, max_new_tokens=6)
    assert result.stdout == PROMPT + completion + "\n"
    assert completion  # the byte model continues, however badly, after 3 steps


def test_load_hf_replicates_key_value_heads_tp_cannot_split_and_names_what_works(tmp_path, caplog):
    """The Python API checks the mesh as a training run does: tp=4 over the tiny Llama's 2
    key/value heads replicates them (one log line, transformers' logits), and tp=8 over its 4
    query heads is one line naming the model's head counts and the tp sizes that work."""
    directory = tiny_hf.write_checkpoint("llama", tmp_path / "llama")
    with caplog.at_level(logging.INFO, logger="meshtrain.weights.load"):
        model = meshtrain.load_hf(directory, [[2, 4], ["fsdp", "tp"]])
    notes = [r.getMessage() for r in caplog.records if "key/value projections" in r.getMessage()]
    assert notes == [
        "tp=4 does not divide model.num_kv_heads=2: the key/value projections are replicated "
        "over tp, and each rank repeats the key/value heads its 1 query heads read"
    ]
    ours = np.asarray(model(tiny_hf.TOKENS.astype(np.int32)))
    theirs = tiny_hf.reference("llama")["logits"]
    assert tiny_hf.relative_error(ours, theirs) <= tiny_hf.LOGIT_TOLERANCE
    with pytest.raises(ConfigError) as error:
        meshtrain.load_hf(directory, [[1, 8], ["fsdp", "tp"]])
    assert str(error.value) == (
        "tp=8 in model.mesh_shape does not divide model.num_heads=4; model llama has 4 query "
        "heads and 2 key/value head(s); use tp in {1, 2, 4} (divisors of model.num_heads=4, "
        "model.mlp_dim=128, model.vocab_size=512)"
    )
