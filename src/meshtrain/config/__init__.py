"""Configuration: the typed schema, start-up validation and the Hydra glue.

`from meshtrain.config import Config, ModelConfig, ...` names the schema (meshtrain.config.schema).
"""

from meshtrain.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DistributedConfig,
    ExperimentConfig,
    ModelConfig,
    PlanConfig,
    ProfileConfig,
    TrainingConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DistributedConfig",
    "ExperimentConfig",
    "ModelConfig",
    "PlanConfig",
    "ProfileConfig",
    "TrainingConfig",
]
