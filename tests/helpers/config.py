"""The typed config a command line would run with."""

from hydra import compose, initialize_config_dir

from helpers.paths import CONFIG_DIR, HF_CONFIGS, REPO
from meshtrain.config import Config
from meshtrain.config.hydra import register_configs, to_config

__all__ = ["CONFIG_DIR", "HF_CONFIGS", "REPO", "compose_config"]


def compose_config(*overrides: str) -> Config:
    """The typed config `python run_training.py <overrides>` would run with."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=list(overrides)))
