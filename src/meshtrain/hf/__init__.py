"""Hugging Face interop for the llama, qwen3 and gemma3 families: local checkpoints in
(`model.init_from=hf:/dir`, `load_hf`) and out (`export_hf`).

The functions are imported on first use: `meshtrain.hf.config` is needed by config validation,
which must not pull in the training code.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"load_hf": "meshtrain.hf.model", "export_hf": "meshtrain.hf.export"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'meshtrain.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
