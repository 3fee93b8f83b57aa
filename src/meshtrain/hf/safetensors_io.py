"""Reads slices of the tensors of a safetensors checkpoint directory; streams tensors into files.

Reading goes through `safe_open(...).get_slice`, which copies only the requested rows and
columns out of the memory-mapped file. Writing streams one tensor at a time after a header
computed from the shapes alone, so neither side ever holds more than one tensor on the host.
Format: https://github.com/huggingface/safetensors#format
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes  # registers numpy's "bfloat16", which safetensors' numpy reader needs
import numpy as np
from safetensors import SafetensorError, safe_open

from meshtrain.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {
    "float32": ("F32", np.dtype(np.float32)),
    "bfloat16": ("BF16", np.dtype(ml_dtypes.bfloat16)),
}


class CheckpointReader:
    """The tensors of a Hugging Face checkpoint directory by name: model.safetensors, or the
    shards listed in model.safetensors.index.json."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.directory / file for name, file in weight_map.items()}
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise ConfigError(
                    f"{self.directory} holds no *.safetensors files; export the weights in the "
                    "safetensors format (save_pretrained does by default)"
                )
            self._file_of = {}
            for file in files:
                with _opened(file) as handle:
                    self._file_of.update({name: file for name in handle.keys()})  # noqa: SIM118
        self._handles: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self._file_of)

    def _slice(self, name: str):
        file = self._file_of[name]
        if not file.is_file():
            raise ConfigError(f"{file} is listed in {INDEX_FILE} but does not exist")
        if file not in self._handles:
            self._handles[file] = _opened(file)
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: Sequence[slice]) -> np.ndarray:
        """The block `index` (one contiguous slice per dimension) of tensor `name`."""
        return self._slice(name)[tuple(index)]


def _opened(file: Path) -> Any:
    """safe_open of `file`; ConfigError in one line for a file that is not safetensors (truncated
    by an interrupted copy, a damaged header, other bytes)."""
    try:
        return safe_open(file, framework="numpy")
    except (SafetensorError, OSError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(
            f"{file} is not a readable safetensors file ({reason}); copy or export it again"
        ) from None


def write_safetensors(
    path: Path,
    entries: Sequence[tuple[str, tuple[int, ...]]],
    dtype: str,
    produce: Callable[[str], np.ndarray],
) -> None:
    """Writes the tensors `entries` (name, shape) of `dtype` to `path`, asking `produce(name)`
    for each one in turn, so only one tensor is ever in host memory."""
    code, np_dtype = DTYPES[dtype]
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        size = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for name, shape in entries:
            array = np.ascontiguousarray(produce(name), dtype=np_dtype)
            if array.shape != tuple(shape):
                raise ValueError(f"{name}: produced shape {array.shape}, expected {tuple(shape)}")
            file.write(array.tobytes())
