"""Hydra glue: the schema registered in Hydra's ConfigStore, and a composed config made typed."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from meshtrain.config.schema import Config


def register_configs() -> None:
    """Registers the schema so that configs/*.yaml are type-checked against it."""
    ConfigStore.instance().store(name="config_schema", node=Config)


def to_config(cfg: DictConfig) -> Config:
    """Converts a composed Hydra config into typed dataclasses."""
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, Config):
        obj = Config(**{k: v for k, v in obj.items() if k in Config.__dataclass_fields__})
    return obj
