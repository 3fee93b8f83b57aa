"""`python -m meshtrain.export`: the parameters alone, as orbax (loadable again), safetensors or a
Hugging Face checkpoint."""

import dataclasses
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from helpers.commands import module_command
from helpers.config import compose_config
from safetensors.numpy import load_file

from meshtrain.checkpoint import find_checkpoints, named_leaves, read_meta, read_params
from meshtrain.checkpoint.layout import save_args
from meshtrain.data import build_tokenizer
from meshtrain.inference.export import ExportError, export
from meshtrain.models.transformer import Transformer
from meshtrain.train.guard import initial_record
from meshtrain.train.state import TrainState, split_state


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """Checkpoints of steps 5 and 7 of the tiny model with random parameters (no training)."""
    directory = tmp_path_factory.mktemp("run") / "checkpoints"
    cfg = compose_config()
    config = dataclasses.asdict(cfg)
    abstract = nnx.to_pure_dict(
        nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)
    )
    with ocp.CheckpointManager(directory) as manager:
        for step in (5, 7):
            rng = np.random.default_rng(step)
            params = jax.tree.map(
                lambda leaf, rng=rng: rng.standard_normal(leaf.shape, np.float32), abstract
            )
            state = TrainState(
                step=np.int32(step),
                params=params,
                opt_state=(),
                rng=np.zeros(2, np.uint32),
                nonfinite=initial_record(),
            )
            meta = {"step": step, "data": {"step": step}, "global_batch": 8, "config": config}
            manager.save(step, args=save_args(*split_state(state), meta))
    return directory


def test_orbax_export_is_a_params_only_checkpoint(checkpoint_dir, tmp_path):
    source = export(checkpoint_dir.parent, tmp_path / "out")  # a run dir: the newest step
    assert source == checkpoint_dir / "7"
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == ["meta", "params"]
    assert find_checkpoints(tmp_path / "out") == [tmp_path / "out"]  # usable by load_params
    original, _ = read_params(source)
    exported, meta = read_params(tmp_path / "out")  # checks every fingerprint
    assert meta["step"] == 7 and meta["source"] == str(source)
    assert len(meta["fingerprints"]) == 20  # embed, final norm, 9 arrays in each of 2 blocks
    assert {"params.embed", "params.blocks.1.mlp.up"} <= set(meta["fingerprints"])
    for name, array in named_leaves(original).items():
        np.testing.assert_array_equal(named_leaves(exported)[name], array)


def test_safetensors_export_names_tensors_by_path(checkpoint_dir, tmp_path):
    export(checkpoint_dir / "5", tmp_path / "st", "safetensors")
    tensors = load_file(tmp_path / "st" / "model.safetensors")
    original = named_leaves(read_params(checkpoint_dir / "5")[0])
    assert len(tensors) == 20 and {"embed", "blocks.0.attn.q", "final_norm.scale"} <= set(tensors)
    for name, array in tensors.items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, original[name])
    config = json.loads((tmp_path / "st" / "config.json").read_text())
    assert (
        config["step"] == 5
        and config["model"] == read_meta(checkpoint_dir / "5")["config"]["model"]
    )


def test_hf_export_writes_the_family_checkpoint(checkpoint_dir, tmp_path):
    export(checkpoint_dir, tmp_path / "hf", "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 2
    byte = build_tokenizer("byte")
    assert (config["bos_token_id"], config["eos_token_id"]) == (byte.bos_id, byte.eos_id)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    original = named_leaves(read_params(checkpoint_dir / "7")[0])
    # Tied embeddings: the token embedding alone; the final norm's scale as it is.
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], original["embed"])
    np.testing.assert_array_equal(tensors["model.norm.weight"], original["final_norm.scale"])
    assert "model.layers.1.mlp.down_proj.weight" in tensors


def test_export_refuses_bad_input(checkpoint_dir, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="is not empty; export into a new directory"):
        export(checkpoint_dir, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="holds no complete checkpoint"):
        export(tmp_path / "full", tmp_path / "new")
    with pytest.raises(ExportError, match="--format onnx is not supported; use one of: orbax"):
        export(checkpoint_dir, tmp_path / "new", "onnx")


def test_export_command_line_error_is_one_line(tmp_path):
    # The successful command lines are run by tests/docs/test_checkpoint_docs.py.
    result = module_command("meshtrain.export", [tmp_path / "missing", tmp_path / "out"], devices=1)
    assert result.returncode == 2
    assert (
        result.stderr.strip() == f"meshtrain: error: checkpoint {tmp_path}/missing does not exist"
    )
    assert not (tmp_path / "out").exists()
