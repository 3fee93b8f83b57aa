"""The console scripts name the same commands as `python run_training.py` and `python -m ...`."""

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

COMMANDS = {
    "meshtrain-train": "meshtrain.cli.train:main",
    "meshtrain-generate": "meshtrain.cli.generate:main",
    "meshtrain-export": "meshtrain.cli.export:main",
    "meshtrain-launch": "meshtrain.cli.launch:main",
    "meshtrain-prepare": "meshtrain.data.prepare_command:main",
}


def test_every_entry_point_is_a_console_script():
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert {name: scripts.get(name) for name in COMMANDS} == COMMANDS
    for name in COMMANDS:
        assert callable(entry_points(group="console_scripts", name=name)[name].load())


@pytest.mark.parametrize(
    ("module", "usage"),
    [
        ("meshtrain.launch", "usage: python -m meshtrain.launch"),
        ("meshtrain.generate", "usage: python -m meshtrain.generate"),
        ("meshtrain.export", "usage: python -m meshtrain.export"),
        ("meshtrain.data.prepare", "usage: python -m meshtrain.data.prepare"),
    ],
)
def test_python_dash_m_forms_still_work(module, usage):
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(usage)
