"""Where the repository, its configs and the tests' data are, wherever a test file lives."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "configs"
# The published config.json of each model of configs/model/ (tests/hf_configs/<name>.json).
HF_CONFIGS = REPO / "tests" / "hf_configs"
