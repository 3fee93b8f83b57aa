"""Loads a local Hugging Face checkpoint (`model.init_from=hf:/dir`) into meshtrain parameters.

Each parameter is created with `jax.make_array_from_callback` in its target sharding: for every
device the callback reads only that device's block of the tensor from the memory-mapped
safetensors file. So the host holds at most one device's block at a time and no device ever
holds more than its own shards. With scan_layers the per-layer arrays are stacked on the devices.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.config import ModelConfig
from meshtrain.errors import ConfigError
from meshtrain.families import REGISTERED
from meshtrain.families.layouts import Layout, PerExpert, expert_names
from meshtrain.hf.config_json import check_matches, read_config_json
from meshtrain.hf.safetensors_io import CheckpointReader
from meshtrain.hf.tensor_map import MODEL_PREFIXES, ParamPath, hf_entries, hf_tensors
from meshtrain.models.transformer import Transformer

HF_SCHEME = "hf:"


def checkpoint_dir(init_from: str) -> Path:
    """The directory named by `model.init_from=hf:/path`."""
    if not init_from.startswith(HF_SCHEME):
        raise ConfigError(
            f"model.init_from={init_from!r} is not supported; use hf:/path/to/checkpoint_dir "
            "(a local Hugging Face checkpoint: config.json and *.safetensors)"
        )
    path = Path(init_from[len(HF_SCHEME) :]).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model.init_from={init_from!r}: {path} is not a directory; point it at a local "
            "Hugging Face checkpoint (config.json and *.safetensors)"
        )
    return path


def resolve_tensors(
    cfg: ModelConfig, reader: CheckpointReader
) -> dict[ParamPath, tuple[str, Layout]]:
    """Our parameter path → (tensor name in this checkpoint, layout)."""
    names = reader.names()
    prefix = next((p for p in MODEL_PREFIXES if f"{p}embed_tokens.weight" in names), None)
    if prefix is None:
        raise ConfigError(
            f"{reader.directory} has no embed_tokens.weight under {', '.join(MODEL_PREFIXES)}; "
            f"it is not a language model checkpoint of {', '.join(REGISTERED)}"
        )
    return hf_tensors(cfg, prefix)


def unstacked_shapes(cfg: ModelConfig) -> dict[ParamPath, tuple[int, ...]]:
    """Shape of every parameter in the layout with one entry per layer. Every block has the
    same shapes, so a one-block abstract model (no memory, and fast at any depth) tells them."""
    one_block = dataclasses.replace(cfg, scan_layers=False, num_layers=1)
    abstract = nnx.eval_shape(lambda: Transformer(one_block, rngs=nnx.Rngs(0)))
    shapes = {}
    for path, variable in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        if path[0] == "blocks":
            shapes.update({("blocks", i, *path[2:]): variable.shape for i in range(cfg.num_layers)})
        else:
            shapes[tuple(path)] = variable.shape
    return shapes


def check_init_from(cfg: ModelConfig) -> None:
    """config.json agrees with `cfg`, and every tensor is there with its shape (headers only)."""
    directory = checkpoint_dir(cfg.init_from)
    source = str(directory / "config.json")
    check_matches(cfg, read_config_json(directory), source)
    reader = CheckpointReader(directory)
    names = reader.names()
    shapes = unstacked_shapes(cfg)
    for name, path, _, _, expected in hf_entries(resolve_tensors(cfg, reader), shapes.__getitem__):
        if name not in names:
            raise ConfigError(
                f"model.init_from={cfg.init_from!r}: the checkpoint has no tensor {name}, needed "
                f"for {'.'.join(map(str, path))}; is it complete?"
            )
        if reader.shape(name) != expected:
            raise ConfigError(
                f"model.init_from={cfg.init_from!r}: tensor {name} has shape "
                f"{list(reader.shape(name))} but config.json implies {list(expected)}"
            )


def checkpoint_summary(directory: Path, cfg: ModelConfig) -> str:
    """What `load_params` reads from `directory`, for the log: "<N> tensors, <model_type>"."""
    count = len(resolve_tensors(cfg, CheckpointReader(directory)))
    return f"{count} tensors, {read_config_json(directory).get('model_type')}"


def _read_sharded(
    reader: CheckpointReader,
    name: str,
    layout: Layout | PerExpert,
    shape: tuple[int, ...],
    sharding: NamedSharding,
    dtype: jnp.dtype,
) -> jax.Array:
    def read(name: str, layout: Layout, shape: tuple[int, ...], index: tuple[slice, ...]):
        block = reader.read(name, layout.hf_slices(shape, index))
        return layout.to_ours(block, shape, index).astype(dtype)

    def read_block(index: tuple[slice, ...]) -> np.ndarray:
        if not isinstance(layout, PerExpert):
            return read(name, layout, shape, index)
        experts = expert_names(name, shape[0])[index[0]]  # one HF tensor per expert
        return np.stack([read(e, layout.inner, shape[1:], index[1:]) for e in experts])

    return jax.make_array_from_callback(shape, sharding, read_block)


def _get(tree: Any, path: ParamPath) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: Any, path: ParamPath, value: Any) -> None:
    _get(tree, path[:-1])[path[-1]] = value


def load_params(
    directory: Path,
    cfg: ModelConfig,
    abstract_params: Any,
    shardings: Any,
    *,
    dtype: jnp.dtype = jnp.float32,
) -> Any:
    """The parameters (nested dict like `abstract_params`) read from the checkpoint in
    `directory`, each array created in its sharding from `shardings`."""
    reader = CheckpointReader(directory)
    return read_params(reader, resolve_tensors(cfg, reader), cfg, abstract_params, shardings, dtype)


def read_params(
    reader: CheckpointReader,
    tensors: dict[ParamPath, tuple[str, Layout]],
    cfg: ModelConfig,
    abstract_params: Any,
    shardings: Any,
    dtype: jnp.dtype = jnp.float32,
) -> Any:
    """The parameters `tensors` names (our unstacked path → tensor name, layout) read from
    `reader` into a nested dict like `abstract_params`, in `shardings`; with scan_layers the
    layers' tensors stacked on the devices."""
    params = jax.tree.map(lambda leaf: leaf, abstract_params)  # same structure, to fill in
    for path, (name, layout) in tensors.items():
        if cfg.scan_layers and path[0] == "blocks":
            continue
        shape = _get(abstract_params, path).shape
        _set(params, path, _read_sharded(reader, name, layout, shape, _get(shardings, path), dtype))
    if cfg.scan_layers:
        for first in [path for path in tensors if path[:2] == ("blocks", 0)]:
            inner, layout = first[2:], tensors[first][1]
            path = ("blocks", *inner)
            stacked_shape, sharding = _get(abstract_params, path).shape, _get(shardings, path)
            # One layer's slice of the stacked sharding: the same spec without the layers axis.
            layer_sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
            layers = [
                _read_sharded(
                    reader,
                    tensors[("blocks", i, *inner)][0],
                    layout,
                    stacked_shape[1:],
                    layer_sharding,
                    dtype,
                )
                for i in range(cfg.num_layers)
            ]
            stack = jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)
            _set(params, path, stack(*layers))
    return params
