"""The checks tests/conftest.py makes of the whole session when it ends: the tests wrote nothing
into the checkout (Hydra's `outputs/` and `multirun/` there), and a session of the default (not
slow) tests imported neither torch nor transformers, which the `test` extra does not install.

Imports nothing but the standard library and helpers.paths: conftest.py loads it before JAX.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from helpers.paths import REPO

# Where Hydra puts a run started without hydra.run.dir (a sweep without hydra.sweep.dir),
# relative to the working directory.
RUN_ROOTS = ("outputs", "multirun")
# The `parity` extra's packages (pyproject.toml): only slow tests may import them.
HEAVY_MODULES = ("torch", "transformers")
_SHOWN = 10  # paths named in the message; the rest are counted

Snapshot = dict[str, tuple[int, int]]


def snapshot(root: Path = REPO, names: Iterable[str] = RUN_ROOTS) -> Snapshot:
    """Each of `names` under `root` that exists, and every path below it, relative to `root`
    → (size, mtime_ns) for a file, (-1, 0) for a directory (its mtime moves with its entries,
    which are listed themselves)."""
    paths = {}
    for name in names:
        top = root / name
        if not top.exists():
            continue
        for path in [top, *top.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                paths[path.relative_to(root).as_posix()] = (-1, 0)
            else:
                stat = path.lstat()
                paths[path.relative_to(root).as_posix()] = (stat.st_size, stat.st_mtime_ns)
    return paths


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    """The paths that appeared, went or changed between two snapshots, sorted."""
    return sorted(
        path for path in before.keys() | after.keys() if before.get(path) != after.get(path)
    )


def checkout_message(changed: list[str], root: Path = REPO) -> str:
    shown = ", ".join(str(root / path) for path in changed[:_SHOWN])
    more = f" and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
    return (
        f"the tests wrote into the checkout: {shown}{more} appeared, changed or went; give each "
        "run hydra.run.dir (a sweep hydra.sweep.dir) under tmp_path, or start the child in "
        "helpers.process.scratch_dir() (run_python and run_training do by default)"
    )


def heavy_imports(modules: Mapping[str, object] | None = None) -> list[str]:
    """The HEAVY_MODULES this process imported (an entry None only blocks an import:
    meshtrain.observe.metrics hides torch from tensorboardX that way)."""
    modules = sys.modules if modules is None else modules
    return [name for name in HEAVY_MODULES if modules.get(name) is not None]


def heavy_import_message(imported: list[str]) -> str:
    names = " and ".join(imported)
    return (
        f"the default (not slow) tests imported {names}, which `pip install -e '.[test]'` does "
        f"not install: import {names} inside slow tests only (in the test function or a "
        "fixture), never at a test module's top level, where collecting the module imports it "
        "even when `-m 'not slow'` deselects its tests"
    )
