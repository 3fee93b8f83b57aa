"""scripts/ keeps the rule of src/ (tests/architecture/test_layout.py): no file over 400 lines."""

from pathlib import Path

import pytest
from helpers.paths import REPO

MAX_LINES = 400
SCRIPTS = sorted((REPO / "scripts").rglob("*.py"))


def test_the_scripts_are_found():
    assert REPO / "scripts" / "benchmark.py" in SCRIPTS
    assert REPO / "scripts" / "bench" / "common.py" in SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_script_over_400_lines(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO)} has {lines} lines; split it"
