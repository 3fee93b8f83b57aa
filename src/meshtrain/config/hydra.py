"""Hydra glue: the schema registered in Hydra's ConfigStore, a composed config made typed, and
the typed config a command line would run with (`compose_config`)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from meshtrain.config.schema import Config
from meshtrain.errors import ConfigError, did_you_mean

CHECKOUT_CONFIGS = Path(__file__).resolve().parents[3] / "configs"
"""configs/ of the checkout this package runs from (an editable install)."""


def compose_config(*overrides: str, config_dir: Path | str | None = None) -> Config:
    """The typed config `python run_training.py <overrides>` would run with, from config_dir
    (default: configs/ of this checkout), without running anything: no run directory, no log."""
    from hydra import compose, initialize_config_dir  # Hydra's compose API, on first use

    register_configs()
    directory = str(CHECKOUT_CONFIGS if config_dir is None else config_dir)
    with initialize_config_dir(config_dir=directory, version_base="1.3"):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def register_configs() -> None:
    """Registers the schema so that configs/*.yaml are type-checked against it, and the
    resolver of configs/config.yaml's default experiment.name."""
    ConfigStore.instance().store(name="config_schema", node=Config)
    OmegaConf.register_new_resolver("meshtrain.run_name", run_name, replace=True)


QUANTISED_BASES = ("int8", "nf4")  # model.lora.base_dtype values that make LoRA QLoRA


def run_name(model: str, source: str, objective: str, lora_rank: int, base_dtype: str) -> str:
    """The default experiment.name (the folder under outputs/): the model's name, then what
    the run does to it when it is not pretraining: its objective (dpo) or chat data (chat),
    and its adapters (lora, qlora). tiny, tiny-chat, qwen3_0_6b-chat-qlora, tiny-dpo-lora."""
    parts = [model]
    if objective != "lm":
        parts.append(objective)
    elif source == "chat":
        parts.append("chat")
    if int(lora_rank) > 0:
        parts.append("qlora" if base_dtype in QUANTISED_BASES else "lora")
    return "-".join(parts)


def _section(field: dataclasses.Field) -> type | None:
    """The dataclass of a section field (Config.training → TrainingConfig), else None."""
    factory = field.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def schema_keys(schema: type = Config, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the schema, sections included: "training", "training.steps", ..."""
    for field in dataclasses.fields(schema):
        yield f"{prefix}{field.name}"
        if section := _section(field):
            yield from schema_keys(section, f"{prefix}{field.name}.")


def _unknown_keys(node: Any, schema: type, prefix: str = "") -> Iterator[str]:
    """Keys of a composed config that the schema lacks (added with `+key=value`)."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for name in node:
        field = fields.get(str(name))
        if field is None:
            yield f"{prefix}{name}"
        elif section := _section(field):
            yield from _unknown_keys(node[name], section, f"{prefix}{name}.")


def unknown_key_message(key: str) -> str:
    """The one-line error for a key the schema lacks, with the closest existing key."""
    return (
        f"unknown config key '{key}'{did_you_mean(key, schema_keys())}; list the keys with "
        "`python run_training.py --cfg job`"
    )


def list_entry_keys(schema: type = Config, prefix: str = "") -> Iterator[tuple[str, type]]:
    """Every list-of-dataclass key of the schema with its entry dataclass:
    ("data.mixture", MixtureSource)."""
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        if section := _section(field):
            yield from list_entry_keys(section, f"{prefix}{field.name}.")
            continue
        hint = hints[field.name]
        args = typing.get_args(hint)
        if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
            yield f"{prefix}{field.name}", args[0]


def unknown_entry_key_message(key: str, list_key: str, entry: type, index: int | None) -> str:
    """The one-line error for a key that an entry of the list `list_key` (a data.mixture source,
    dataclass `entry`) lacks, with the closest field of the entry; `index`: the entry, if known."""
    fields = [field.name for field in dataclasses.fields(entry)]
    where = (
        f"'{list_key}[{index}].{key}'" if index is not None else f"'{key}' in a {list_key} entry"
    )
    return (
        f"unknown config key {where}{did_you_mean(key, fields)}; "
        f"a {list_key} entry has the keys {', '.join(fields)}"
    )


def to_config(cfg: DictConfig) -> Config:
    """Converts a composed Hydra config into typed dataclasses; a key the schema lacks (added
    with `+key=value`) is a ConfigError, never silently dropped."""
    for key in _unknown_keys(cfg, Config):
        raise ConfigError(unknown_key_message(key))
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, Config):
        obj = Config(**{k: v for k, v in obj.items() if k in Config.__dataclass_fields__})
    return obj


def config_from_dict(saved: dict[str, Any]) -> Config:
    """The typed Config of a resolved config saved as a dict (a checkpoint's meta/config)."""
    return to_config(OmegaConf.merge(OmegaConf.structured(Config), saved))
