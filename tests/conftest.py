"""Test set-up: 8 faked CPU devices, set before JAX starts, a shared compilation cache, the
fixtures, and two checks of the whole session (helpers.guards): it fails if the checkout's
outputs/ or multirun/ gained paths while tests ran (the tests', or another process's: the message
says which test ran), or if a session without slow tests imported torch or transformers. The
code tests share is in tests/helpers/ (`from helpers.config import ...`)."""
# ruff: noqa: E402  (the environment must be set before anything imports jax)

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

from helpers.process import FAST_COMPILE  # the standard library only: JAX is not loaded yet

from meshtrain.distributed.xla_flags import with_cpu_collective_timeouts  # the same

# Must happen before jax initialises its backend (i.e. before any test imports jax).
os.environ["XLA_FLAGS"] = with_cpu_collective_timeouts(
    f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE} --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most test launches compile the same few small programs: a compilation cache shared by this
# session's processes (and inherited by the subprocesses) compiles each of them once. A fresh
# directory per session, so nothing carries over from one session to the next.
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="meshtrain-test-jax-cache-")
atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILATION_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# meshtrain's own caches (the CPU matmul peak, packed corpora) in a directory of this session
# too: the suite never reads or leaves anything in the user's ~/.cache.
_MESHTRAIN_CACHE = tempfile.mkdtemp(prefix="meshtrain-test-cache-")
atexit.register(shutil.rmtree, _MESHTRAIN_CACHE, ignore_errors=True)
os.environ["MESHTRAIN_CACHE_DIR"] = _MESHTRAIN_CACHE

from pathlib import Path

import pytest
from helpers import guards

_CHECKOUT = pytest.StashKey[guards.Snapshot]()
_WINDOWS = pytest.StashKey[list[guards.Window]]()
_SLOW_SELECTED = pytest.StashKey[bool]()
_FAILURES = pytest.StashKey[list[str]]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_CHECKOUT] = guards.snapshot()
    session.config.stash[_WINDOWS] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Keep the time each test ran (set-up and teardown included): a path of the checkout
    written while none ran is not the tests'."""
    start = time.time_ns()
    try:
        return (yield)
    finally:
        window = guards.Window(item.nodeid, start, time.time_ns())
        item.config.stash.setdefault(_WINDOWS, []).append(window)


def pytest_collection_finish(session: pytest.Session) -> None:
    # The tests this session runs, after `-m` (the default 'not slow') and `-k` deselected theirs.
    selected = any(item.get_closest_marker("slow") for item in session.items)
    session.config.stash[_SLOW_SELECTED] = selected


def pytest_sessionfinish(session: pytest.Session) -> None:
    failures = []
    windows = session.config.stash.get(_WINDOWS, [])
    found = guards.suspects(session.config.stash[_CHECKOUT], guards.snapshot(), windows)
    if found:
        failures.append(guards.checkout_message(found))
    imported = guards.heavy_imports()
    if imported and not session.config.stash.get(_SLOW_SELECTED, True):
        failures.append(guards.heavy_import_message(imported))
    if failures:
        session.config.stash[_FAILURES] = failures
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    for failure in config.stash.get(_FAILURES, []):
        terminalreporter.write_line(f"FAILED (session): {failure}", red=True, bold=True)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path
