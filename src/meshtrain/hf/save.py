"""`export_hf`: meshtrain parameters → a Hugging Face checkpoint directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads (config.json, *.safetensors, tokenizer).

Tensors are gathered to the host and written one at a time, so host memory stays at about one
tensor. The directory is written under a temporary name and renamed when complete: an
interrupted export leaves no half-written checkpoint, and an existing directory is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshtrain.config import ModelConfig
from meshtrain.data.tokenizer import Tokenizer, build_tokenizer, save_tokenizer
from meshtrain.errors import ConfigError, DataError
from meshtrain.hf.config_json import hf_config_from_model
from meshtrain.hf.safetensors_io import DTYPES, INDEX_FILE, write_safetensors
from meshtrain.hf.tensor_map import ParamPath, hf_entries, hf_tensors

DEFAULT_SHARD_BYTES = 4 * 2**30


def gather(array: jax.Array) -> np.ndarray:
    """The whole array on this host (all processes must call this together when multi-process)."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def locate(params: Any, path: ParamPath, scan_layers: bool) -> tuple[jax.Array, int | None]:
    """The array holding our parameter `path` (unstacked layout), and its layer in the stack
    when scan_layers stacked the blocks (else None)."""
    layer = None
    if scan_layers and path[0] == "blocks":
        layer, path = path[1], ("blocks", *path[2:])
    for key in path:
        params = params[key]
    return params, layer


def _files(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Tensor indices per file, in order, each file at most max_shard_bytes (or one tensor)."""
    files: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if files[-1] and used + size > max_shard_bytes:
            files.append([])
            used = 0
        files[-1].append(i)
        used += size
    return files


def generation_config(special: dict[str, int], directory: Path) -> dict[str, Any]:
    """generation_config.json's ids: the tokenizer's special ids, and as eos also the tokens
    that close an assistant turn where the tokenizer in `directory` has a chat template (as
    published chat checkpoints list them, so that transformers' generate stops at the end of an
    answer: `<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`)."""
    from meshtrain.data.chat.encoder import build_chat_encoder  # jinja2: only for an export

    try:
        stops = build_chat_encoder(str(directory)).stop_ids
    except (DataError, ValueError):  # no chat template, or no tokenizer.json
        return dict(special)
    eos = [special["eos_token_id"]] if "eos_token_id" in special else []
    ids = list(dict.fromkeys([*eos, *stops]))
    return {**special, "eos_token_id": ids if len(ids) > 1 else ids[0]} if ids else dict(special)


def export_hf(
    params: Any,
    model_cfg: ModelConfig,
    out_dir: str | os.PathLike,
    tokenizer: Tokenizer | str | os.PathLike | None = None,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Writes `params` (the nested dict of a TrainState's params, or of
    `nnx.state(model, nnx.Param)`) as a Hugging Face checkpoint of `model_cfg.family` into the
    new directory `out_dir`. `tokenizer` (a data.tokenizer value or a built Tokenizer) is copied
    along and gives the bos/eos/pad ids. `dtype`: float32 (lossless) or bfloat16. Files larger
    than max_shard_bytes are split, with a model.safetensors.index.json."""
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists; export into a new directory")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use {' or '.join(DTYPES)}")
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = build_tokenizer(str(tokenizer))
    special = {}
    if tokenizer is not None:
        roles = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id}
        special = {f"{role}_token_id": i for role, i in roles.items() if i >= 0}
    config = hf_config_from_model(model_cfg, dtype=dtype, special_tokens=special)

    def unstacked(path: ParamPath) -> tuple[int, ...]:
        array, layer = locate(params, path, model_cfg.scan_layers)
        return array.shape if layer is None else array.shape[1:]

    entries = hf_entries(hf_tensors(model_cfg), unstacked)  # one per HF tensor
    shapes = [hf_shape for *_, hf_shape in entries]
    itemsize = DTYPES[dtype][1].itemsize
    sizes = [int(np.prod(s, dtype=np.int64)) * itemsize for s in shapes]
    files = _files(sizes, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    is_main = jax.process_index() == 0
    partial = out.parent / f".{out.name}.partial"
    if is_main:
        shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted export
        partial.mkdir(parents=True)

    def produce(name: str) -> np.ndarray:
        _, path, expert, layout, _ = entries[index_of[name]]
        array, layer = locate(params, path, model_cfg.scan_layers)
        array = array if layer is None else array[layer]
        return layout.to_hf(gather(array if expert is None else array[expert]))

    index_of = {entry[0]: i for i, entry in enumerate(entries)}
    for file, members in zip(names, files, strict=True):
        written = [(entries[i][0], shapes[i]) for i in members]
        if is_main:
            write_safetensors(partial / file, written, dtype, produce)
        else:  # take part in the gathers of a multi-process export
            for name, _ in written:
                produce(name)
    if not is_main:
        return out
    if len(files) > 1:
        weight_map = {entries[i][0]: file for file, m in zip(names, files, strict=True) for i in m}
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (partial / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, partial)
    if special:
        generation = generation_config(special, partial)
        (partial / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if out.exists():
        out.rmdir()  # empty, checked above
    partial.rename(out)
    return out
