"""The console scripts name the same commands as `python run_training.py` and `python -m ...`."""

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from meshtrain.prog import prog_name

COMMANDS = {
    "meshtrain-train": "meshtrain.cli.train:main",
    "meshtrain-generate": "meshtrain.cli.generate:main",
    "meshtrain-export": "meshtrain.cli.export:main",
    "meshtrain-launch": "meshtrain.cli.launch:main",
    "meshtrain-prepare": "meshtrain.cli.prepare:main",
    "meshtrain-eval": "meshtrain.cli.eval:main",
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
        ("meshtrain.eval", "usage: python -m meshtrain.eval"),
    ],
)
def test_python_dash_m_forms_still_work(module, usage):
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(usage)


@pytest.mark.parametrize(
    "script",
    [
        "meshtrain-launch",
        "meshtrain-generate",
        "meshtrain-export",
        "meshtrain-prepare",
        "meshtrain-eval",
    ],
)
def test_console_scripts_name_themselves_in_their_usage(script):
    path = Path(sys.executable).parent / script
    if not path.is_file():
        pytest.skip(f"{script} is not installed next to {sys.executable}")
    result = subprocess.run([str(path), "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {script} [-h]")


def test_a_console_scripts_bad_input_names_the_script():
    path = Path(sys.executable).parent / "meshtrain-prepare"
    if not path.is_file():
        pytest.skip(f"meshtrain-prepare is not installed next to {sys.executable}")
    result = subprocess.run([str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "meshtrain: error: the following arguments are required: PATH, --out "
        "(see meshtrain-prepare --help)"
    )


@pytest.mark.parametrize(
    ("argv0", "prog"),
    [
        ("/venv/bin/meshtrain-launch", "meshtrain-launch"),
        ("meshtrain-export", "meshtrain-export"),
        ("/src/meshtrain/launch.py", "python -m meshtrain.launch"),  # python -m meshtrain.launch
        ("/venv/bin/pytest", "python -m meshtrain.launch"),  # main() called from Python
        ("", "python -m meshtrain.launch"),
    ],
)
def test_prog_name(argv0, prog):
    assert prog_name("meshtrain.launch", argv0) == prog
