"""Ready-to-call models for scripts and notebooks: `load_hf` from a local Hugging Face
checkpoint directory, `load_checkpoint` from a meshtrain checkpoint (or run directory, or orbax
export), `load_safetensors_export` from `meshtrain.export --format safetensors`. Each reads
every array straight into its shards on the mesh it is given. `load_tokenizer` finds the
tokenizer that goes with any of them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from meshtrain.checkpoint.layout import (
    CorruptCheckpoint,
    find_checkpoints,
    named_leaves,
    read_meta,
    read_params,
)
from meshtrain.config.hydra import config_from_dict
from meshtrain.config.schema import ModelConfig
from meshtrain.data.tokenizer import TOKENIZER_FILES, Tokenizer, build_tokenizer
from meshtrain.errors import ConfigError
from meshtrain.hf.config_json import model_config_from_hf, read_config_json
from meshtrain.hf.load import check_init_from, load_params
from meshtrain.hf.safetensors_io import CheckpointReader
from meshtrain.models.abstract import (
    AbstractModel,
    abstract_model,
    merge_model,
    replicated_kv_heads,
)
from meshtrain.models.frozen import is_quantized
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.mesh import MeshSpec, resolve_mesh
from meshtrain.weights.lora_base import check_base_unchanged, load_frozen_base
from meshtrain.weights.moved_tokenizer import find_moved_tokenizer

log = logging.getLogger(__name__)


def _abstract_model(
    cfg: ModelConfig, mesh: Mesh, spec: MeshSpec, dtype: jnp.dtype = jnp.float32
) -> AbstractModel:
    """abstract_model (a LoRA base stored for the compute `dtype`), with the one line that
    says when the key/value heads are replicated over tp (as a training run's start-up says)."""
    model = abstract_model(cfg, mesh, spec, dtype)
    note = replicated_kv_heads(cfg, spec)
    if note:
        log.info(note)
    return model


def hf_model_config(path: str | Path, **fields: Any) -> ModelConfig:
    """The ModelConfig of the checkpoint in `path` (from its config.json), plus `fields`."""
    directory = Path(path).expanduser()
    return model_config_from_hf(
        read_config_json(directory),
        name=directory.name,
        source=str(directory / "config.json"),
        **fields,
    )


def load_hf(
    path: str | Path,
    mesh: Mesh | list[Any] | None = None,
    *,
    dtype: jnp.dtype = jnp.float32,
    scan_layers: bool = False,
) -> Transformer:
    """The model of the checkpoint in `path` (config.json and *.safetensors), parameters in
    `dtype`. `mesh`: None (one device), a mesh_shape such as [[4,2],["fsdp","tp"]] over all
    visible devices, or a Mesh from `meshtrain.parallel.mesh.build_mesh`; each device then holds only its
    shards. Call it as `model(tokens)`: int32 [B, T] → logits [B, T, vocab_size]."""
    directory = Path(path).expanduser()
    cfg = hf_model_config(directory, scan_layers=scan_layers, init_from=f"hf:{directory}")
    check_init_from(cfg)  # every tensor present with its shape, before anything is allocated
    mesh, spec = resolve_mesh(mesh)
    model = _abstract_model(cfg, mesh, spec)
    params = load_params(directory, cfg, model.abstract_params, model.param_shardings, dtype=dtype)
    return merge_model(model, params)


def _candidates(path: Path) -> list[Path]:
    found = find_checkpoints(Path(path).expanduser())
    if not found:
        raise ConfigError(
            f"{path} holds no complete meshtrain checkpoint (a directory with params/ and "
            "meta/, a directory of step directories, or a run directory with checkpoints/)"
        )
    return found


def checkpoint_config(path: str | Path) -> dict[str, Any]:
    """The resolved run config saved with the newest checkpoint at `path` whose description
    reads back, as a dict ({"model": {...}, "data": {...}, ...})."""
    return checkpoint_meta(path)["config"]


def checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """What the newest checkpoint at `path` whose description reads back records of its run:
    its config, its tokenizer's identity, ... (train.resume.run_meta)."""
    for candidate in _candidates(Path(path)):
        try:
            return read_meta(candidate)
        except CorruptCheckpoint as err:
            log.warning("%s; trying the previous checkpoint", err)
    raise ConfigError(f"no readable checkpoint at {path}")


def load_checkpoint(
    path: str | Path,
    mesh: Mesh | list[Any] | None = None,
    *,
    dtype: jnp.dtype = jnp.float32,
) -> Transformer:
    """The model of the newest readable checkpoint at `path` (a step directory such as
    .../checkpoints/200, its checkpoints/ directory, a run directory or an orbax export), built
    from the model config saved with it. `mesh` as in `load_hf`: None (one device), a
    mesh_shape over all visible devices, or a Mesh; each array is read straight into its
    shards. Call it as `model(tokens)`: int32 [B, T] → logits [B, T, vocab_size]."""
    mesh, spec = resolve_mesh(mesh)
    for candidate in _candidates(Path(path)):
        try:
            meta = read_meta(candidate)
            cfg = ModelConfig(**meta["config"]["model"])
            model = _abstract_model(cfg, mesh, spec, dtype)
            target = jax.tree.map(
                lambda leaf, sharding: jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=sharding
                ),
                model.trainable_params,
                model.trainable_shardings,
            )
            params, _ = read_params(candidate, target)
        except CorruptCheckpoint as err:
            log.warning("%s; trying the previous checkpoint", err)
            continue
        if model.lora:  # adapters: the base is read from where the run read it
            params = model.full_params(params, lora_base(meta, model, candidate))
        cast = lambda p: p.astype(dtype)  # noqa: E731
        return merge_model(model, jax.tree.map(cast, params, is_leaf=is_quantized))
    raise ConfigError(f"no readable checkpoint at {path}")


def lora_base(meta: dict[str, Any], model: AbstractModel, where: Path) -> Any:
    """The frozen base of the LoRA checkpoint at `where` (described by `meta`), stored as in
    training: read from the run's model.init_from or checkpoint.load_params (or drawn from its
    seed), after checking that its files are those the adapters were trained on."""
    run = config_from_dict(meta["config"])
    check_base_unchanged(run, meta.get("lora_base"), where)
    log.info("LoRA adapters of %s on the base %s", where, meta["lora_base"]["source"])
    return load_frozen_base(run, model)


def _safetensors_export_config(directory: Path) -> dict[str, Any] | None:
    """The config.json of a `meshtrain.export --format safetensors` directory ({"model": {...},
    "step": ..., "source": ...}); None for any other directory."""
    file = directory / "config.json"
    if not (file.is_file() and (directory / "model.safetensors").is_file()):
        return None
    config = json.loads(file.read_text())
    return config if isinstance(config.get("model"), dict) and "source" in config else None


def load_safetensors_export(
    path: str | Path,
    mesh: Mesh | list[Any] | None = None,
    *,
    dtype: jnp.dtype = jnp.float32,
) -> Transformer:
    """The model of a `meshtrain.export --format safetensors` directory (config.json with the
    model config, model.safetensors with tensors named by path). `mesh` as in `load_hf`."""
    directory = Path(path).expanduser()
    config = _safetensors_export_config(directory)
    if config is None:
        raise ConfigError(
            f"{directory} is not a safetensors export (config.json with a model config and "
            "model.safetensors)"
        )
    mesh, spec = resolve_mesh(mesh)
    model = _abstract_model(ModelConfig(**config["model"]), mesh, spec)
    reader = CheckpointReader(directory)
    shardings = named_leaves(model.param_shardings)
    arrays = [
        jax.make_array_from_callback(
            leaf.shape,
            shardings[name],
            lambda index, name=name: reader.read(name, index).astype(dtype),
        )
        for name, leaf in named_leaves(model.abstract_params).items()
    ]
    params = jax.tree.unflatten(jax.tree.structure(model.abstract_params), arrays)
    return merge_model(model, params)


def load_model(
    path: str | Path, mesh: Mesh | list[Any] | None = None, *, dtype: jnp.dtype = jnp.float32
) -> Transformer:
    """The model at `path`, whichever kind it is: a meshtrain checkpoint (or run directory, or
    orbax export), a safetensors export or a Hugging Face checkpoint directory."""
    directory = Path(path).expanduser()
    _refuse_adapter_alone(directory)
    if find_checkpoints(directory):
        return load_checkpoint(directory, mesh, dtype=dtype)
    if _safetensors_export_config(directory) is not None:
        return load_safetensors_export(directory, mesh, dtype=dtype)
    return load_hf(directory, mesh, dtype=dtype)


def _refuse_adapter_alone(directory: Path) -> None:
    """ConfigError for a PEFT export (`meshtrain-export --format peft`): adapters without the
    model they adapt, which generation and evaluation cannot run."""
    if (directory / "adapter_config.json").is_file() and not find_checkpoints(directory):
        raise ConfigError(
            f"{directory} holds LoRA adapters alone (a PEFT export), not a model; run the LoRA "
            "run directory they were exported from, or a merged export (python -m "
            "meshtrain.export RUN_DIR OUT --format hf --merge)"
        )


def load_tokenizer(path: str | Path, *, option: str = "--tokenizer ") -> Tokenizer:
    """The tokenizer that goes with the model at `path` (as `load_model` reads it): the one a
    meshtrain checkpoint was trained with (its data.tokenizer), else the tokenizer.json or
    tokenizer.model that an export or a Hugging Face checkpoint carries. `option`: how the
    calling command is given a tokenizer, for the error without one."""
    directory = Path(path).expanduser()
    _refuse_adapter_alone(directory)
    recorded = None
    if found := find_checkpoints(directory):
        meta = checkpoint_meta(directory)
        recorded = meta["config"]["data"]["tokenizer"]
        try:
            return build_tokenizer(recorded)
        except ValueError:
            pass  # moved, or relative to another directory: found by its contents, else an
            # export may still carry it
        identity = meta.get("tokenizer")
        if identity and (moved := find_moved_tokenizer(recorded, identity, found[0])):
            return build_tokenizer(str(moved))
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        return build_tokenizer(str(directory))
    trained_with = (
        f"was trained with data.tokenizer={recorded!r}, which is not found from {Path.cwd()}, "
        "and holds"
        if recorded
        else "holds"
    )
    raise ConfigError(
        f"{directory} {trained_with} no {' or '.join(TOKENIZER_FILES)}; pass the tokenizer the "
        f"model was trained with: {option}byte, {option}PATH/tokenizer.json (or .model), "
        f"or {option}DIRECTORY holding one"
    )
