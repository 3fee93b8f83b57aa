"""meshtrain: a config-driven training launcher for JAX language models.

For scripts and notebooks (imported on first use, so `import meshtrain` stays light):
`meshtrain.load_hf(path, mesh=None)`, `meshtrain.load_checkpoint(path, mesh=None)` or
`meshtrain.load_model(path, mesh=None)` (any of them, or an export) → model, `model(tokens)` →
logits, `meshtrain.load_tokenizer(path)` → its tokenizer,
`meshtrain.build_tokenizer(path)`, `meshtrain.generate(model, tokenizer, prompt, max_new_tokens)`
and `meshtrain.export_hf(params, model_cfg, out_dir, tokenizer)`.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "load_hf": ("meshtrain.weights.load", "load_hf"),
    "load_checkpoint": ("meshtrain.weights.load", "load_checkpoint"),
    "load_model": ("meshtrain.weights.load", "load_model"),
    "load_tokenizer": ("meshtrain.weights.load", "load_tokenizer"),
    "export_hf": ("meshtrain.hf.save", "export_hf"),
    "build_tokenizer": ("meshtrain.data.tokenizer", "build_tokenizer"),
    "generate": ("meshtrain.inference.generate", "generate"),
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    return getattr(importlib.import_module(module_name), attribute)
