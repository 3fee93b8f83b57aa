"""Hugging Face interop against transformers' own numbers: logits and one training step agree for
every family; import straight into a sharded mesh; exports; bad input. transformers' numbers are
committed fixtures (helpers.tiny_hf), so these tests need no torch; test_interop_live.py (slow)
recomputes them and runs the round trips through transformers itself."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_hf
from helpers.commands import train_command
from helpers.config import compose_config
from helpers.tiny_hf import FAMILIES, LOGIT_TOLERANCE, TOKENS, relative_error, run_config
from safetensors.numpy import load_file

from meshtrain.errors import ConfigError
from meshtrain.hf.load import check_init_from
from meshtrain.hf.safetensors_io import INDEX_FILE, CheckpointReader
from meshtrain.hf.save import export_hf
from meshtrain.hf.tensor_map import hf_tensors
from meshtrain.models.abstract import merge_model
from meshtrain.train.loop import train
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.setup import prepare
from meshtrain.train.state import create_train_state, state_shardings
from meshtrain.weights import initial_weights
from meshtrain.weights.initial_weights import load_initial_params
from meshtrain.weights.load import load_hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family → its checkpoint directory. Gemma's is split into several files with a
    model.safetensors.index.json."""
    return {f: tiny_hf.write_checkpoint(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


_config = run_config


def _start(cfg, devices):
    """The train state as a run starts it (with model.init_from: the checkpoint's weights)."""
    setup = prepare(cfg, devices)
    tx = build_optimizer(cfg.training)
    with jax.set_mesh(setup.mesh):
        shardings = state_shardings(setup.model, tx, setup.mesh)
        # No checkpoint.load_params here: no checkpoint directory is read.
        params = load_initial_params(cfg, setup.model, checkpoint_dir_of_run=Path("unused"))
        state = create_train_state(cfg.model, tx, shardings, cfg.training.seed, params)
    return setup, state


def _logits(setup, params, tokens=TOKENS):
    return np.asarray(merge_model(setup.model, params)(jnp.asarray(tokens, jnp.int32)))


@pytest.fixture(scope="module")
def trained(checkpoints, tmp_path_factory):
    """family → the RunResult of one training step from the family's checkpoint (1 device)."""
    results = {}

    def get(family):
        if family not in results:
            cfg = _config(
                family,
                checkpoints[family],
                *tiny_hf.STEP_ONE,
                f"training.micro_batch_size={tiny_hf.STEP_ONE_BATCH}",
            )
            run_dir = tmp_path_factory.mktemp(f"run-{family}")
            results[family] = train(cfg, run_dir, devices=jax.devices()[:1])
        return results[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fixtures_were_made_from_the_inputs_the_tests_use(family):
    """transformers' committed numbers are for these weights (numpy's generator), tokens and
    step-1 batch (the data pipeline): else the comparisons below would fail for no fault of
    meshtrain's. The fix then is to rerun tests/fixtures/hf/make_fixtures.py (parity extra)."""
    committed = json.loads((tiny_hf.FIXTURES / "inputs.json").read_text())[family]
    now = tiny_hf.fingerprint(family)
    stale = "stale fixtures: rerun tests/fixtures/hf/make_fixtures.py"
    np.testing.assert_allclose(now["weights"], committed["weights"], rtol=1e-6, err_msg=stale)
    assert (now["tokens"], now["step_one_batch"]) == (
        committed["tokens"],
        committed["step_one_batch"],
    ), stale


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, checkpoints):
    setup, state = _start(_config(family, checkpoints[family]), jax.devices()[:1])
    theirs = tiny_hf.reference(family)["logits"]
    assert relative_error(_logits(setup, state.params), theirs) <= LOGIT_TOLERANCE


def test_init_from_logs_the_tensors_it_read(checkpoints):
    """Like checkpoint.load_params, model.init_from confirms in one line what it read."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    level = initial_weights.log.level
    initial_weights.log.addHandler(handler)
    initial_weights.log.setLevel(logging.INFO)
    try:
        _start(_config("llama", checkpoints["llama"]), jax.devices()[:1])
    finally:
        initial_weights.log.removeHandler(handler)
        initial_weights.log.setLevel(level)
    assert lines == [
        f"parameters from hf:{checkpoints['llama']} (30 tensors, llama); the optimizer, step "
        "and data position start fresh"
    ]


@pytest.mark.parametrize(
    "family", [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_one_training_step_matches_transformers(family, trained):
    result = trained(family)
    theirs = tiny_hf.reference(family)  # on the batch of the run's step 1 (step_one_batch)
    # The loss is a mean of 160 log-probabilities whose logits agree to ~1e-6 relative.
    np.testing.assert_allclose(result.history[0]["loss"], theirs["loss"], rtol=1e-5)
    np.testing.assert_allclose(result.history[0]["grad_norm"], theirs["grad_norm"], rtol=1e-4)


@pytest.mark.slow  # about 9 s on 2 cores
def test_bf16_end_to_end_stays_close_to_transformers_fp32(checkpoints, tmp_path):
    directory = checkpoints["gemma3"]
    cfg = _config(
        "gemma3",
        directory,
        "training.mixed_precision=bf16",
        *tiny_hf.STEP_ONE,
        f"training.micro_batch_size={tiny_hf.STEP_ONE_BATCH}",
    )
    result = train(cfg, tmp_path, devices=jax.devices()[:1])
    loss = tiny_hf.reference("gemma3")["loss"]
    # bf16 matmuls (8-bit mantissa) move a loss of ~6 by about a part in a thousand.
    np.testing.assert_allclose(result.history[0]["loss"], loss, rtol=1e-2)
    assert result.history[0]["loss"] != loss
    assert {a.dtype for a in jax.tree.leaves(result.state.params)} == {np.dtype("float32")}
    # Inference in bf16: parameters stored in bf16, logits in bf16.
    model = load_hf(directory, dtype=jnp.bfloat16)
    logits = model(jnp.asarray(TOKENS, jnp.int32))
    assert logits.dtype == jnp.bfloat16
    ours = np.asarray(logits.astype(jnp.float32))
    assert relative_error(ours, tiny_hf.reference("gemma3")["logits"]) < 3e-2


def test_scan_layers_and_remat_import_the_same_weights(checkpoints):
    cfg = _config("gemma3", checkpoints["gemma3"], "model.scan_layers=true", "model.remat=full")
    setup, state = _start(cfg, jax.devices()[:1])
    assert state.params["blocks"]["attn"]["q"].shape == (7, 64, 4, 16)  # [layers, D, N, H]
    theirs = tiny_hf.reference("gemma3")["logits"]
    assert relative_error(_logits(setup, state.params), theirs) <= LOGIT_TOLERANCE


def _shard_count(array) -> int:
    mesh = array.sharding.mesh
    axes = [a for entry in array.sharding.spec if entry for a in np.atleast_1d(entry)]
    return math.prod(mesh.shape[a] for a in axes)


@pytest.mark.slow
def test_import_into_a_sharded_mesh_reads_and_holds_only_each_devices_shards(
    checkpoints, monkeypatch
):
    directory = checkpoints["gemma3"]
    reads = []
    read = CheckpointReader.read

    def recording_read(self, name, index):
        block = read(self, name, index)
        reads.append((name, block.nbytes))
        return block

    monkeypatch.setattr(CheckpointReader, "read", recording_read)
    cfg = _config(
        "gemma3", directory, "model.mesh_shape=[[4,2],[fsdp,tp]]", "training.micro_batch_size=1"
    )
    setup, state = _start(cfg, jax.devices())
    names = {name: path for path, (name, _) in hf_tensors(cfg.model).items()}
    hf_weights = tiny_hf.weights("gemma3")
    for name, path in names.items():
        array = state.params
        for key in path:
            array = array[key]
        per_device = [shard.data.nbytes for shard in array.addressable_shards]
        assert len(per_device) == 8
        assert set(per_device) == {array.nbytes // _shard_count(array)}, name
        # Every read of the file was one device's block, in the file's dtype (fp32 here).
        assert {size for n, size in reads if n == name} == {array.nbytes // _shard_count(array)}
    # The embedding [512, 64] is split 2 ways (tp) by vocab and 4 ways (fsdp) by embed.
    assert state.params["embed"].addressable_shards[0].data.shape == (256, 16)
    assert _shard_count(state.params["blocks"][0]["attn"]["q"]) == 8  # [64/4, 4/2, 16]
    q = np.asarray(state.params["blocks"][5]["attn"]["q"])  # [D, N, H]
    q_proj = hf_weights["model.layers.5.self_attn.q_proj.weight"]  # [N*H, D]
    np.testing.assert_array_equal(q, q_proj.reshape(4, 16, 64).transpose(2, 0, 1))
    tokens = np.concatenate([TOKENS, TOKENS[:, ::-1]])  # 4 rows: the batch is split 4 ways
    with jax.set_mesh(setup.mesh):
        ours = _logits(setup, state.params, tokens)
    reference = tiny_hf.reference("gemma3")
    theirs = np.concatenate([reference["logits"], reference["logits_reversed"]])
    assert relative_error(ours, theirs) <= LOGIT_TOLERANCE


def test_export_bf16_in_several_files_with_scan_layers(checkpoints, tmp_path):
    """The files and values; transformers reading them back: test_interop_live.py."""
    directory = checkpoints["gemma3"]
    cfg = _config("gemma3", directory, "model.scan_layers=true")
    _, state = _start(cfg, jax.devices()[:1])
    out = export_hf(
        state.params, cfg.model, tmp_path / "out", dtype="bfloat16", max_shard_bytes=100_000
    )
    index = json.loads((out / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    name = "model.layers.6.mlp.down_proj.weight"
    exported = load_file(out / index["weight_map"][name])[name]
    original = tiny_hf.weights("gemma3")[name]
    # Round to nearest even, as torch's .to(torch.bfloat16).
    np.testing.assert_array_equal(exported, original.astype(jnp.bfloat16))


def test_export_never_overwrites(checkpoints, tmp_path):
    directory = checkpoints["llama"]
    cfg = _config("llama", directory)
    _, state = _start(cfg, jax.devices()[:1])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists; export into a new directory"):
        export_hf(state.params, cfg.model, tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_config_mismatch_names_the_field_and_both_values(checkpoints):
    directory = checkpoints["llama"]
    with pytest.raises(ConfigError) as err:
        check_init_from(_config("llama", directory, "model.num_layers=4").model)
    assert str(err.value) == (
        f"model.num_layers=4 does not match num_hidden_layers in {directory}/config.json "
        "(model.num_layers=3); choose the model config of this checkpoint or set "
        "model.num_layers=3"
    )


def test_wrong_family_on_the_command_line_is_one_line_and_exit_code_2(checkpoints, tmp_path):
    directory = checkpoints["llama"]
    run_dir = tmp_path / "outputs" / "gemma3_1b" / "2026-01-31" / "12-00-00"
    result = train_command(
        "model=gemma3_1b", f"model.init_from=hf:{directory}", f"hydra.run.dir={run_dir}", devices=1
    )
    assert not (tmp_path / "outputs" / "gemma3_1b").exists()  # the rejected run left nothing
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"meshtrain: error: model.family=gemma3 does not match model_type in "
        f"{directory}/config.json (model.family=llama); choose the model config of this "
        "checkpoint or set model.family=llama"
    ]


def test_init_from_needs_a_checkpoint_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"is not supported; use hf:/path/to/checkpoint_dir"):
        check_init_from(compose_config("model.init_from=/models/x").model)
    with pytest.raises(ConfigError, match="is not a directory"):
        check_init_from(compose_config(f"model.init_from=hf:{tmp_path}/missing").model)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf.SPECS["qwen3"][0]))
    with pytest.raises(ConfigError, match=r"holds no \*\.safetensors files"):
        check_init_from(compose_config(*tiny_hf.overrides("qwen3", tmp_path)).model)
