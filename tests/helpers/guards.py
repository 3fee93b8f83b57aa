"""The checks tests/conftest.py makes of the whole session when it ends: the tests wrote nothing
into the checkout (Hydra's `outputs/` and `multirun/` there), and a session of the default (not
slow) tests imported neither torch nor transformers, which the `test` extra does not install.

Who wrote a file is not knowable afterwards: a user's own `python run_training.py` writes the
same `outputs/` while the suite runs. What is knowable, and all the check goes on:

- what appeared or changed between the session's start and its end (two snapshots);
- when (its mtime), so a path written while no test ran is not the tests': the windows are the
  [start, end] of each test, kept by conftest.py;
- where: the suite always makes a new run directory, it never writes into a run directory that
  existed before the session (a user's run going on while the suite runs writes only there).

A path that passes all three was written by a test or by another process; the message says so.
Imports nothing but the standard library and helpers.paths: conftest.py loads it before JAX.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from helpers.paths import REPO

# Where Hydra puts a run started without hydra.run.dir (a sweep without hydra.sweep.dir),
# relative to the working directory.
RUN_ROOTS = ("outputs", "multirun")
# The `parity` extra's packages (pyproject.toml): only slow tests may import them.
HEAVY_MODULES = ("torch", "transformers")
_SHOWN = 3  # example paths named in the message; the rest are counted
# A file's mtime comes from the kernel's coarse clock, a tick behind time.time_ns(): a window
# stretches by this much either side.
_SLACK_NS = 100_000_000

Snapshot = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class Window:
    """The time one test ran, in time.time_ns() (the clock of file mtimes)."""

    test: str
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class Suspect:
    """A path (relative to the checkout) that appeared or changed while `test` ran."""

    path: str
    test: str


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


def run_dirs(before: Snapshot) -> set[str]:
    """The directories of `before` that held a file or a `.hydra/` directly: the run directories
    that existed before the session (not a run root, nor a date directory of runs)."""
    found = set()
    for path, (size, _) in before.items():
        parent, _, name = path.rpartition("/")
        if parent and "/" in parent and (size != -1 or name.startswith(".hydra")):
            found.add(parent)
    return found


def _in_old_run(path: str, old_runs: set[str]) -> bool:
    """Whether `path` is in (or is) a run directory that existed before the session."""
    parts = path.split("/")
    return any("/".join(parts[:i]) in old_runs for i in range(2, len(parts) + 1))


def _test_at(mtime_ns: int, windows: Sequence[Window]) -> str | None:
    """The test that ran at `mtime_ns`, or None when none did."""
    return next(
        (w.test for w in windows if w.start_ns - _SLACK_NS <= mtime_ns <= w.end_ns + _SLACK_NS),
        None,
    )


def suspects(
    before: Snapshot, after: Snapshot, windows: Sequence[Window], root: Path = REPO
) -> list[Suspect]:
    """The paths of `after` that appeared or changed since `before`, outside every run
    directory of `before`, whose mtime falls while a test ran, topmost only (a new directory
    stands for what is below it), sorted. A path that went is left out: when it went, and who
    removed it, is not knowable, and the tests never remove what they did not write."""
    old_runs = run_dirs(before)
    found: list[Suspect] = []
    for path in sorted(p for p in after if before.get(p) != after[p]):
        if _in_old_run(path, old_runs) or any(path.startswith(f"{s.path}/") for s in found):
            continue
        try:
            mtime = (root / path).lstat().st_mtime_ns
        except FileNotFoundError:
            continue
        test = _test_at(mtime, windows)
        if test is not None:
            found.append(Suspect(path, test))
    return found


def checkout_message(found: Sequence[Suspect], root: Path = REPO) -> str:
    """One line: how many paths, that the tests or another process wrote them, a few examples
    with the test that was running, and how a test keeps out of the checkout."""
    shown = "; ".join(f"{root / s.path} (while {s.test} ran)" for s in found[:_SHOWN])
    more = f"; and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    count = f"{len(found)} path{'s' if len(found) != 1 else ''}"
    return (
        f"{count} appeared or changed in the checkout's outputs/ or multirun/ while tests ran, "
        f"written by the tests or by another process (a run of yours started meanwhile?): "
        f"{shown}{more}. A test gives each run hydra.run.dir (a sweep hydra.sweep.dir) under "
        "tmp_path, or starts its child in helpers.process.scratch_dir() (run_python and "
        "run_training do by default)"
    )


def heavy_imports(modules: Mapping[str, object] | None = None) -> list[str]:
    """The HEAVY_MODULES this process imported (an entry None only blocks an import:
    meshtrain.observe.trackers.tensorboard hides torch from tensorboardX that way)."""
    modules = sys.modules if modules is None else modules
    return [name for name in HEAVY_MODULES if modules.get(name) is not None]


def heavy_import_message(imported: list[str]) -> str:
    """The failure of a default session that imported `imported`."""
    names = " and ".join(imported)
    return (
        f"the default (not slow) tests imported {names}, which `pip install -e '.[test]'` does "
        f"not install: import {names} inside slow tests only (in the test function or a "
        "fixture), never at a test module's top level, where collecting the module imports it "
        "even when `-m 'not slow'` deselects its tests"
    )
