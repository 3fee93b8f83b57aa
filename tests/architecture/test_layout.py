"""The package layout of docs/architecture.md holds: no import cycle between packages (imports
inside functions included) nor between modules (as the program runs), a handful of top-level
modules, no module over 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "meshtrain"
MAX_TOP_LEVEL_MODULES = 8
MAX_LINES = 400


def unit_of(module: str) -> str:
    """The architectural unit of a dotted module name: its package under meshtrain, or the
    top-level module itself ("meshtrain.train.loop" → "train", "meshtrain.units" → "units")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "meshtrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.Module, runtime_only: bool) -> list[ast.AST]:
    """Every node of `tree` but those under `if __name__ == "__main__":` (run only as a script,
    when the module is __main__, not itself: an entry point such as `python -m
    meshtrain.data.prepare` calling its command in cli/); with `runtime_only`, not those under
    `if TYPE_CHECKING:` either (read by type checkers only)."""
    skipped_tests = {"__name__ == '__main__'"}
    if runtime_only:
        skipped_tests |= {"TYPE_CHECKING", "typing.TYPE_CHECKING"}

    def skipped(node: ast.AST) -> bool:
        return isinstance(node, ast.If) and ast.unparse(node.test) in skipped_tests

    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(child for child in ast.iter_child_nodes(node) if not skipped(child))
    return nodes


def imported_modules(path: Path, *, runtime_only: bool = False) -> set[str]:
    """Every meshtrain module `path` imports, at the top or inside a function (with
    `runtime_only`, as the program runs: see _runtime_nodes)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text()), runtime_only):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            # `from meshtrain import x` imports the submodule meshtrain.x when there is one
            found.update(
                f"{target}.{alias.name}"
                for alias in node.names
                if (SRC.parent / f"{target}.{alias.name}".replace(".", "/")).exists()
                or (SRC.parent / (f"{target}.{alias.name}".replace(".", "/") + ".py")).exists()
            )
    return {name for name in found if name == "meshtrain" or name.startswith("meshtrain.")}


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        source = unit_of(module_name(path))
        targets = {unit_of(name) for name in imported_modules(path)} - {source, "meshtrain"}
        graph.setdefault(source, set()).update(targets)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_chain():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_lazy_imports_count():
    imports = imported_modules(SRC / "cli" / "train.py")  # imports the loop inside a function
    assert "meshtrain.train.loop" in imports


def test_no_import_cycle_between_packages():
    cycle = find_cycle(unit_graph())
    assert cycle is None, "import cycle between packages: " + " → ".join(cycle)


def module_graph() -> dict[str, set[str]]:
    """module → the meshtrain modules it imports as the program runs."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        module = module_name(path)
        imports = imported_modules(path, runtime_only=True) - {module}
        graph.setdefault(module, set()).update(imports)
    return graph


def test_no_import_cycle_between_modules():
    """Within a package as well: a package's __init__ counts as a module (importing a name from
    the package imports it)."""
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle between modules: " + " → ".join(cycle)


def test_type_only_and_script_only_imports_are_no_runtime_edges():
    graph = module_graph()
    # config/lora.py names ModelConfig for type checkers only; data/prepare.py runs the prepare
    # command under `if __name__ == "__main__":`.
    assert "meshtrain.config.schema" not in graph["meshtrain.config.lora"]
    assert "meshtrain.cli.prepare" not in graph["meshtrain.data.prepare"]
    assert "meshtrain.data.prepare" in graph["meshtrain.cli.prepare"]


def test_lower_packages_never_import_training_or_the_command_line():
    graph = unit_graph()
    for lower in (
        "hardware",
        "config",
        "parallel",
        "models",
        "data",
        "hf",
        "checkpoint",
        "observe",
        "weights",
    ):
        assert not graph.get(lower, set()) & {"train", "cli", "inference"}, lower
    # Training starts from weights (meshtrain.weights), never from the inference package.
    assert not graph["train"] & {"cli", "inference"}


def test_a_handful_of_modules_at_the_top():
    top = sorted(p.name for p in SRC.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES - 1, top  # with __init__.py, at most 8


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_over_400_lines(path: Path):
    assert len(path.read_text().splitlines()) <= MAX_LINES
