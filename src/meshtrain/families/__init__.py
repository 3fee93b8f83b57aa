"""Model families, each declared in one module (families.base.Family): llama, qwen3, gemma3,
qwen3_moe, mixtral.

Adding a family is its module here, one entry in `_MODULES`, its configs/model/*.yaml, its test
fixtures and its docs (docs/architecture.md#adding-a-family); nothing else names a family.
"""

from __future__ import annotations

import importlib

from meshtrain.errors import ConfigError, did_you_mean
from meshtrain.families.base import Family

_MODULES = ("llama", "qwen3", "gemma3", "qwen3_moe", "mixtral")

REGISTERED: dict[str, Family] = {
    family.name: family
    for family in (importlib.import_module(f"{__name__}.{m}").FAMILY for m in _MODULES)
}
"""model.family → its declaration."""

DEFAULT_FAMILY = "llama"
"""model.family of a model config that names none."""


def family(name: str) -> Family:
    """The family `name` (model.family); ConfigError naming the registered ones otherwise."""
    if name not in REGISTERED:
        raise ConfigError(
            f"model.family={name!r} is not supported; use one of: {', '.join(REGISTERED)}"
            f"{did_you_mean(str(name), REGISTERED)}"
        )
    return REGISTERED[name]


def family_of_model_type(model_type: str | None, source: str) -> Family:
    """The family that reads config.json's `model_type`; ConfigError if none does."""
    for candidate in REGISTERED.values():
        if model_type == candidate.model_type or model_type in candidate.also_reads:
            return candidate
    read = [t for f in REGISTERED.values() for t in (f.model_type, *f.also_reads)]
    raise ConfigError(
        f"{source}: model_type {model_type!r} is not supported; meshtrain reads "
        f"{', '.join(read)} checkpoints"
    )
