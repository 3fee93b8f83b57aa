"""Writes a checkpoint's parameters alone; its command line is `python -m meshtrain.export
<checkpoint> <out_dir>` (meshtrain.cli.export).

`<checkpoint>` is a checkpoint directory (`.../checkpoints/200`), a directory of them (the newest
readable one is taken) or a run directory. Formats (`--format`):

  orbax        <out_dir>/params/ and <out_dir>/meta/: a training checkpoint without the optimizer
               state, so `checkpoint.load_params=<out_dir>` fine-tunes from it (the default)
  safetensors  <out_dir>/model.safetensors, tensors named by path ("blocks.0.attn.q"), and
               <out_dir>/config.json with the model config, for sharing and inference
  hf           a Hugging Face checkpoint of the model's family (meshtrain.export_hf):
               config.json, safetensors with transformers' names
  peft         a LoRA run's adapters as a PEFT adapter directory (meshtrain.hf.peft):
               adapter_config.json and adapter_model.safetensors, for the Hugging Face base

A LoRA checkpoint holds adapters only. `--format peft` writes them as they are; every other
format writes a whole model and needs `--merge`: the base the run read (dequantised as the run
computed it, for QLoRA) with each adapter folded into its weight, W + alpha/r · A·B.

Every format carries the run's tokenizer as tokenizer.json (or tokenizer.model) with its
tokenizer_config.json, so `python -m meshtrain.generate <out_dir> PROMPT` needs nothing else; the
byte tokenizer is written as an equivalent tokenizer.json.

A new format is one more function in EXPORTERS. Export reads whole arrays into host memory
(about the size of the parameters) on CPU; it needs no accelerator.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors.numpy import save_file

from meshtrain.checkpoint.layout import (
    FORMAT,
    META,
    PARAMS,
    CorruptCheckpoint,
    find_checkpoints,
    fingerprints,
    named_leaves,
    read_params,
)
from meshtrain.config import ModelConfig
from meshtrain.config.lora import LoraConfig
from meshtrain.data.tokenizer import Tokenizer, build_tokenizer, save_tokenizer
from meshtrain.hf.peft import export_peft
from meshtrain.hf.save import export_hf
from meshtrain.models.frozen import is_quantized
from meshtrain.models.lora import merge_adapters, split_adapters
from meshtrain.models.transformer import Transformer
from meshtrain.weights.load import load_checkpoint

log = logging.getLogger(__name__)


def write_orbax(params: Any, meta: dict[str, Any], out_dir: Path) -> None:
    checkpointer = ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            **{PARAMS: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
        )
    )
    args = {PARAMS: ocp.args.StandardSave(params), META: ocp.args.JsonSave(meta)}
    checkpointer.save(out_dir, args=ocp.args.Composite(**args))
    checkpointer.close()
    _save_run_tokenizer(meta, out_dir)


def write_safetensors(params: Any, meta: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        named_leaves(params), out_dir / "model.safetensors", metadata={"step": str(meta["step"])}
    )
    config = {"model": meta["config"]["model"], "step": meta["step"], "source": meta["source"]}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _save_run_tokenizer(meta, out_dir)


def write_hf(params: Any, meta: dict[str, Any], out_dir: Path) -> None:
    model = ModelConfig(**meta["config"]["model"])
    export_hf(_in_model_tree(params, model), model, out_dir, _run_tokenizer(meta))


def _in_model_tree(params: Any, model: ModelConfig, adapters_only: bool = False) -> Any:
    """Saved parameters in the model's own tree (int keys for the blocks, as export_hf and
    export_peft walk it); the saved tree has the same dotted names, so arrays go by name."""
    abstract = nnx.to_pure_dict(
        nnx.state(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))), nnx.Param)
    )
    if adapters_only:
        abstract = split_adapters(abstract)[0]
    saved = named_leaves(params)
    arrays = [jnp.asarray(saved[name]) for name in named_leaves(abstract)]
    return jax.tree.unflatten(jax.tree.structure(abstract), arrays)


def _run_tokenizer(meta: dict[str, Any]) -> Tokenizer | None:
    """The tokenizer the run trained with (its data.tokenizer), or None, with a warning, when it
    cannot be found from here: the parameters are exported all the same."""
    name = meta["config"]["data"]["tokenizer"]
    try:
        return build_tokenizer(name)
    except ValueError as err:
        log.warning("%s; the export holds no tokenizer (generate then needs --tokenizer)", err)
        return None


def _save_run_tokenizer(meta: dict[str, Any], out_dir: Path) -> None:
    tokenizer = _run_tokenizer(meta)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out_dir)


# --format name → writer(params as numpy arrays, export description, out_dir)
EXPORTERS: dict[str, Callable[[Any, dict[str, Any], Path], None]] = {
    "orbax": write_orbax,
    "safetensors": write_safetensors,
    "hf": write_hf,
}


class ExportError(Exception):
    """Bad input to the export command; reported as one line, exit code 2."""


def _lora_export(
    path: Path, adapters: Any, description: dict[str, Any], fmt: str, merge: bool, out_dir: Path
) -> tuple[Any, dict[str, Any]]:
    """A LoRA checkpoint's export: (None, _) once the PEFT adapter is written, else the merged
    parameters and their description (a plain model's config)."""
    config = description["config"]
    model = ModelConfig(**config["model"])
    if not model.lora.rank:
        what = "--format peft" if fmt == "peft" else "--merge"
        raise ExportError(f"{path} holds no LoRA adapters (model.lora.rank=0): drop {what}")
    if fmt == "peft":
        if merge:
            raise ExportError("--format peft writes the adapters alone; drop --merge")
        init_from = model.init_from
        base = init_from.removeprefix("hf:") if init_from else config["checkpoint"]["load_params"]
        export_peft(_in_model_tree(adapters, model, adapters_only=True), model, out_dir, base)
        return None, description
    if not merge:
        raise ExportError(
            f"{path} holds LoRA adapters only; add --merge to write the base with the "
            "adapters folded in, or use --format peft for the adapters alone"
        )
    merged = nnx.to_pure_dict(nnx.state(load_checkpoint(path), nnx.Param))
    merged = jax.tree.map(lambda leaf: leaf[...], merged, is_leaf=is_quantized)  # dequantised
    merged = merge_adapters(merged, model.lora.alpha / model.lora.rank)
    merged = jax.tree.map(np.asarray, jax.device_get(merged))  # host arrays, as read_params's
    plain = {**config, "model": {**config["model"], "lora": asdict(LoraConfig())}}
    log.info("merged the LoRA adapters (rank %d) into their base", model.lora.rank)
    marks = fingerprints(merged, f"{PARAMS}.")  # of the merged arrays, which a read checks
    return merged, {**description, "config": plain, "fingerprints": marks}


def export(checkpoint: Path, out_dir: Path, fmt: str = "orbax", *, merge: bool = False) -> Path:
    """Writes the parameters of the newest readable checkpoint at `checkpoint`; returns its
    path. merge: fold a LoRA checkpoint's adapters into its base (the formats but peft)."""
    checkpoint, out_dir = checkpoint.resolve(), out_dir.resolve()  # orbax wants absolute paths
    formats = [*EXPORTERS, "peft"]
    if fmt not in formats:
        raise ExportError(f"--format {fmt} is not supported; use one of: {', '.join(formats)}")
    if not checkpoint.exists():
        raise ExportError(f"checkpoint {checkpoint} does not exist")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportError(f"{out_dir} is not empty; export into a new directory")
    candidates = find_checkpoints(checkpoint)
    if not candidates:
        raise ExportError(
            f"{checkpoint} holds no complete checkpoint (a directory with params/ and meta/, "
            "a directory of step directories, or a run directory with checkpoints/)"
        )
    for path in candidates:
        try:
            params, meta = read_params(path)
        except CorruptCheckpoint as err:
            log.warning("%s; trying the previous checkpoint", err)
            continue
        description = {
            "format": FORMAT,
            "step": meta["step"],
            "source": str(path),
            "config": meta["config"],
            "fingerprints": {
                k: v for k, v in meta["fingerprints"].items() if k.startswith("params.")
            },
        }
        lora = ModelConfig(**meta["config"]["model"]).lora
        if fmt == "peft" or merge or lora.rank:
            params, description = _lora_export(path, params, description, fmt, merge, out_dir)
            if params is None:  # written as a PEFT adapter
                return path
        if out_dir.exists():
            out_dir.rmdir()  # empty: orbax renames its temporary directory to this name
        EXPORTERS[fmt](params, description, out_dir)
        return path
    raise ExportError(f"no readable checkpoint at {checkpoint}")
