"""`python -m meshtrain.export`: the parameters alone, as orbax (loadable again) or safetensors."""

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import REPO, compose_config, subprocess_env
from safetensors.numpy import load_file

from meshtrain.checkpoint import find_checkpoints, named_leaves, read_meta, read_params
from meshtrain.checkpoint.layout import save_args
from meshtrain.export import ExportError, export
from meshtrain.train.guard import initial_record
from meshtrain.train.state import TrainState


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """Checkpoints of steps 5 and 7 of a small state with the model's nested-dict layout."""
    directory = tmp_path_factory.mktemp("run") / "checkpoints"
    config = dataclasses.asdict(compose_config())
    with ocp.CheckpointManager(directory) as manager:
        for step in (5, 7):
            keys = jax.random.split(jax.random.key(step), 3)
            params = {
                "embed": jax.random.normal(keys[0], (16, 8)),
                "blocks": {0: {"mlp": {"up": jax.random.normal(keys[1], (8, 32))}}},
                "final_norm": {"scale": jax.random.normal(keys[2], (8,))},
            }
            state = TrainState(
                step=np.int32(step),
                params=params,
                opt_state=(),
                rng=np.zeros(2, np.uint32),
                nonfinite=initial_record(),
            )
            meta = {"step": step, "data": {"step": step}, "global_batch": 8, "config": config}
            manager.save(step, args=save_args(state, meta))
    return directory


def test_orbax_export_is_a_params_only_checkpoint(checkpoint_dir, tmp_path):
    source = export(checkpoint_dir.parent, tmp_path / "out")  # a run dir: the newest step
    assert source == checkpoint_dir / "7"
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == ["meta", "params"]
    assert find_checkpoints(tmp_path / "out") == [tmp_path / "out"]  # usable by load_params
    original, _ = read_params(source)
    exported, meta = read_params(tmp_path / "out")  # checks every fingerprint
    assert meta["step"] == 7 and meta["source"] == str(source)
    assert set(meta["fingerprints"]) == {
        "params.embed",
        "params.blocks.0.mlp.up",
        "params.final_norm.scale",
    }
    for name, array in named_leaves(original).items():
        np.testing.assert_array_equal(named_leaves(exported)[name], array)


def test_safetensors_export_names_tensors_by_path(checkpoint_dir, tmp_path):
    export(checkpoint_dir / "5", tmp_path / "st", "safetensors")
    tensors = load_file(tmp_path / "st" / "model.safetensors")
    original = named_leaves(read_params(checkpoint_dir / "5")[0])
    assert sorted(tensors) == ["blocks.0.mlp.up", "embed", "final_norm.scale"]
    for name, array in tensors.items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, original[name])
    config = json.loads((tmp_path / "st" / "config.json").read_text())
    assert (
        config["step"] == 5
        and config["model"] == read_meta(checkpoint_dir / "5")["config"]["model"]
    )


def test_export_refuses_bad_input(checkpoint_dir, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="is not empty; export into a new directory"):
        export(checkpoint_dir, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="holds no complete checkpoint"):
        export(tmp_path / "full", tmp_path / "new")
    with pytest.raises(
        ExportError, match="--format hf is not supported; use one of: orbax, safetensors"
    ):
        export(checkpoint_dir, tmp_path / "new", "hf")


def test_export_command_line_error_is_one_line(tmp_path):
    # The successful command lines are run by tests/test_checkpoint_docs.py.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtrain.export",
            str(tmp_path / "missing"),
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip() == f"meshtrain: error: checkpoint {tmp_path}/missing does not exist"
    )
    assert not (tmp_path / "out").exists()
