"""Test set-up: 8 faked CPU devices, set before JAX starts, caches shared by the test run, the
fixtures, and two checks of the whole session (helpers.guards): it fails if the checkout's
outputs/ or multirun/ gained paths while tests ran (the tests', or another process's: the message
says which test ran), or if a session without slow tests imported torch or transformers. The
code tests share is in tests/helpers/ (`from helpers.config import ...`). Measuring the suite:
MESHTRAIN_TEST_DURATIONS=FILE (each test's seconds), MESHTRAIN_TEST_COMPILES=FILE (the programs
each test compiled and traced, and their seconds: helpers.compiles)."""
# ruff: noqa: E402  (the environment must be set before anything imports jax)

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from helpers.process import FAST_COMPILE  # the standard library only: JAX is not loaded yet

from meshtrain.distributed.xla_flags import with_cpu_collective_timeouts  # the same

# Must happen before jax initialises its backend (i.e. before any test imports jax).
os.environ["XLA_FLAGS"] = with_cpu_collective_timeouts(
    f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE} --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Nothing is downloaded at run time: a Hugging Face id resolves from the local cache or is
# refused (meshtrain.config.hub_cache), in the tests and in the children they start.
os.environ["HF_HUB_OFFLINE"] = "1"
# Most test launches compile the same few small programs: one JAX compilation cache for the whole
# test run compiles each of them once, and meshtrain's own caches (the CPU matmul peak, packed
# corpora) sit beside it, so the suite never reads or leaves anything in the user's ~/.cache.
# The first pytest process of a run makes them; the processes it starts inherit them (pytest-xdist's
# workers, the tests' child processes). A fresh directory per run, removed at its end, unless
# MESHTRAIN_TEST_CACHE=DIR keeps them in DIR for the next run (.ci/run's slow pass reuses what the
# default suite compiled).
_CACHES_OWNER = "MESHTRAIN_TEST_CACHES_OWNER"
if _CACHES_OWNER not in os.environ:
    os.environ[_CACHES_OWNER] = str(os.getpid())
    _kept = os.environ.get("MESHTRAIN_TEST_CACHE")
    _caches = Path(_kept) if _kept else Path(tempfile.mkdtemp(prefix="meshtrain-test-caches-"))
    if not _kept:
        atexit.register(shutil.rmtree, _caches, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_caches / "jax")
    os.environ["MESHTRAIN_CACHE_DIR"] = str(_caches / "meshtrain")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pytest
from helpers import guards

_CHECKOUT = pytest.StashKey[guards.Snapshot]()
_WINDOWS = pytest.StashKey[list[guards.Window]]()
_SLOW_SELECTED = pytest.StashKey[bool]()
_FAILURES = pytest.StashKey[list[str]]()
_COMPILES = pytest.StashKey[object]()  # helpers.compiles.CompileCounter


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_CHECKOUT] = guards.snapshot()
    session.config.stash[_WINDOWS] = []
    if os.environ.get("MESHTRAIN_TEST_COMPILES"):  # JAX is imported here, its environment set
        from helpers.compiles import CompileCounter

        session.config.stash[_COMPILES] = CompileCounter()


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
        _count_compiles(item)


def _count_compiles(item: pytest.Item) -> None:
    """With MESHTRAIN_TEST_COMPILES=FILE, appends the test's line of compiles (helpers.compiles)."""
    counter = item.config.stash.get(_COMPILES, None)
    if counter is not None:
        with open(os.environ["MESHTRAIN_TEST_COMPILES"], "a", encoding="utf-8") as file:
            file.write(counter.line(item.nodeid))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With MESHTRAIN_TEST_DURATIONS=FILE (.ci/run), appends `seconds<TAB>node id` for each test
    (set-up, call and teardown together) to FILE, for the CI's table of the slowest tests. Under
    pytest-xdist the controller, which receives every worker's reports, writes them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    skipped = os.environ.get("MESHTRAIN_TEST_SKIPPED")
    if skipped and report.skipped:
        # With MESHTRAIN_TEST_SKIPPED=FILE (.ci/run): the node id of each skipped test (an
        # extra it needs is missing), for a second pass in the venv that has every extra.
        with open(skipped, "a", encoding="utf-8") as file:
            file.write(f"{report.nodeid}\n")
    path = os.environ.get("MESHTRAIN_TEST_DURATIONS")
    if not path:
        return
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        with open(path, "a", encoding="utf-8") as file:
            file.write(f"{_DURATIONS.pop(report.nodeid):.2f}\t{report.nodeid}\n")


_DURATIONS: dict[str, float] = {}


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module skipped whole at collection (pytest.importorskip at its top): recorded like a
    skipped test (pytest_runtest_logreport)."""
    skipped = os.environ.get("MESHTRAIN_TEST_SKIPPED")
    if skipped and report.skipped and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(skipped, "a", encoding="utf-8") as file:
            file.write(f"{report.nodeid}\n")


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
