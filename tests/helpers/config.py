"""The typed config a command line would run with (meshtrain.config.hydra.compose_config, from
the checkout's configs/)."""

from helpers.paths import CONFIG_DIR, HF_CONFIGS, REPO
from meshtrain.config.hydra import compose_config

__all__ = ["CONFIG_DIR", "HF_CONFIGS", "REPO", "compose_config"]
