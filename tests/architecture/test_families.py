"""A model family is named in its own module only (docs/architecture.md#adding-a-family): no
string constant of meshtrain's code outside meshtrain/families/ equals a registered family's
name or one of the Hugging Face model_types it reads (docstrings aside)."""

from __future__ import annotations

import ast
from pathlib import Path

from meshtrain.families import REGISTERED

SRC = Path(__file__).resolve().parents[2] / "src" / "meshtrain"
MAY_NAME_A_FAMILY = SRC / "families"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (a statement of their own)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def family_names_in(path: Path) -> list[str]:
    """ "line: 'name'" for each string constant of `path` that names a family."""
    names = {n for f in REGISTERED.values() for n in (f.name, f.model_type, *f.also_reads)}
    tree = ast.parse(path.read_text())
    docstrings = _docstrings(tree)
    return [
        f"{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in names
        and id(node) not in docstrings
    ]


def test_only_the_families_package_names_a_family():
    found = [
        f"{path.relative_to(SRC)}:{hit}"
        for path in sorted(SRC.rglob("*.py"))
        if MAY_NAME_A_FAMILY not in path.parents
        for hit in family_names_in(path)
    ]
    assert found == []


def test_the_check_finds_a_family_named_outside_its_module(tmp_path):
    module = tmp_path / "branch.py"
    module.write_text('"""Docstring: llama."""\n\nif family == "gemma3":\n    pass\n')
    assert family_names_in(module) == ["3: 'gemma3'"]
