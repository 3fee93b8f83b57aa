"""scripts/ keeps the rule of src/ (tests/architecture/test_layout.py): no file over 400 lines; and
no script imports from tests/."""

import ast
from pathlib import Path

import pytest
from helpers.paths import REPO

MAX_LINES = 400
SCRIPTS = sorted((REPO / "scripts").rglob("*.py"))


def test_the_scripts_are_found():
    assert REPO / "scripts" / "benchmark.py" in SCRIPTS
    assert REPO / "scripts" / "bench" / "common.py" in SCRIPTS
    assert REPO / "scripts" / "checks" / "check_claims.py" in SCRIPTS
    assert REPO / "scripts" / "docs" / "make_demo_checkpoint.py" in SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_script_over_400_lines(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO)} has {lines} lines; split it"


def _imports_from_tests(path: Path) -> list[str]:
    """What in `path` reaches into tests/: an import of the tests' `helpers` or `tests`
    packages, or tests/ put on sys.path."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in PATH_CALLS:
            constants = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
            names = ["tests"] if "tests" in constants else []
        else:
            continue
        found += [f"line {node.lineno}: {ast.unparse(node)}" for name in names if _in_tests(name)]
    return found


PATH_CALLS = ("sys.path.insert", "sys.path.append")


def _in_tests(module: str) -> bool:
    return module.split(".")[0] in ("helpers", "tests")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_script_imports_from_tests(path: Path):
    """The scripts' shared code lives in the package or in scripts/ (bench/, the scripts
    themselves), not in the tests' helpers."""
    assert _imports_from_tests(path) == []


def test_an_import_from_tests_is_found(tmp_path: Path):
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        'sys.path.insert(0, str(REPO / "tests"))\n'
        "from helpers.tiny_hf import VOCAB\n"
        "import json\n"
    )
    assert sorted(line.split(":")[0] for line in _imports_from_tests(script)) == [
        "line 2",
        "line 3",
    ]
