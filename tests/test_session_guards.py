"""The session's own checks (tests/conftest.py, helpers.guards): the tests write nothing into the
checkout's outputs/ or multirun/ (and blame them only for what appeared there while a test ran,
outside the runs that were there before), and a session of the default tests imports no torch."""

import os
import subprocess
import sys
import time

import pytest
from helpers.guards import (
    Suspect,
    Window,
    changes,
    checkout_message,
    heavy_import_message,
    heavy_imports,
    snapshot,
    suspects,
)
from helpers.paths import REPO


def test_a_new_run_directory_and_a_changed_file_are_named(tmp_path):
    before = snapshot(tmp_path)
    assert before == {}  # neither outputs/ nor multirun/ exists yet
    log = tmp_path / "outputs" / "tiny" / "2026-01-31" / "train.log"
    log.parent.mkdir(parents=True)
    log.write_text("step 1")
    (tmp_path / "elsewhere.txt").write_text("not a run root")
    after = snapshot(tmp_path)
    assert changes(before, after) == [
        "outputs",
        "outputs/tiny",
        "outputs/tiny/2026-01-31",
        "outputs/tiny/2026-01-31/train.log",
    ]
    assert changes(after, snapshot(tmp_path)) == []
    log.write_text("step 1\nstep 2")
    (tmp_path / "multirun").mkdir()
    assert changes(after, snapshot(tmp_path)) == ["multirun", "outputs/tiny/2026-01-31/train.log"]
    log.unlink()
    assert "outputs/tiny/2026-01-31/train.log" in changes(after, snapshot(tmp_path))


def _window(test: str, seconds: float = 60) -> Window:
    """A window around now, `seconds` either side."""
    now = time.time_ns()
    return Window(test, now - int(seconds * 1e9), now + int(seconds * 1e9))


def test_only_what_appeared_while_a_test_ran_outside_older_runs_is_suspect(tmp_path):
    old_run = tmp_path / "outputs" / "gemma3_270m_chat" / "2026-01-30" / "09-00-00"
    (old_run / ".hydra").mkdir(parents=True)
    (old_run / "train.log").write_text("step 1")
    before = snapshot(tmp_path)
    # A user's run going on while the tests run writes only into its own run directory.
    (old_run / "train.log").write_text("step 1\nstep 2")
    (old_run / "checkpoints" / "100").mkdir(parents=True)
    # A new run directory: the tests' or another process's; topmost only.
    new_run = tmp_path / "outputs" / "tiny" / "2026-01-31" / "12-00-00"
    new_run.mkdir(parents=True)
    for i in range(5):
        (new_run / f"file{i}").write_text("x")
    after = snapshot(tmp_path)
    found = suspects(before, after, [_window("tests/a.py::test_a")], root=tmp_path)
    assert found == [Suspect("outputs/tiny", "tests/a.py::test_a")]
    # Written while no test ran (the windows are long past): not the tests'.
    past = Window("tests/a.py::test_a", 0, 1)
    assert suspects(before, after, [past], root=tmp_path) == []
    # A path that went is nobody's to blame.
    assert suspects(after, before, [_window("t")], root=tmp_path) == []


def test_a_new_run_in_an_existing_date_directory_is_suspect(tmp_path):
    day = tmp_path / "outputs" / "tiny" / "2026-01-31"
    (day / "09-00-00" / ".hydra").mkdir(parents=True)
    before = snapshot(tmp_path)
    (day / "12-00-00").mkdir()
    (day / "12-00-00" / "train.log").write_text("step 1")
    found = suspects(before, snapshot(tmp_path), [_window("t")], root=tmp_path)
    assert [s.path for s in found] == ["outputs/tiny/2026-01-31/12-00-00"]


def test_the_message_is_one_line_with_a_few_examples_and_their_tests():
    found = [Suspect(f"outputs/run{i:03}", f"tests/t.py::test_{i}") for i in range(465)]
    message = checkout_message(found)
    assert "\n" not in message
    assert message.startswith(
        "465 paths appeared or changed in the checkout's outputs/ or multirun/ while tests ran, "
        "written by the tests or by another process (a run of yours started meanwhile?): "
        f"{REPO}/outputs/run000 (while tests/t.py::test_0 ran); "
    )
    assert f"{REPO}/outputs/run002 (while tests/t.py::test_2 ran); and 462 more." in message
    assert "run003" not in message and "hydra.run.dir" in message
    one = checkout_message(found[:1])
    assert one.startswith("1 path appeared") and "more" not in one


def test_only_the_parity_modules_count_as_heavy():
    assert heavy_imports({"jax": 1, "torch": 1, "transformers": 1}) == ["torch", "transformers"]
    assert heavy_imports({"jax": 1, "torchvision_like": 1, "torch": None}) == []
    assert "imported torch, which `pip install -e '.[test]'` does not install" in (
        heavy_import_message(["torch"])
    )


FAKE_TORCH = """
import sys, types

import pytest


def test_imports_torch_by_default():
    sys.modules["torch"] = types.ModuleType("torch")  # a stand-in: nothing is installed or loaded


@pytest.mark.slow
def test_imports_torch_when_slow():
    sys.modules["torch"] = types.ModuleType("torch")
"""


def _pytest(directory, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest with this repository's settings and tests/conftest.py, on a test file elsewhere."""
    paths = [str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]  # `-p conftest` finds it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest"]
    settings = ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(directory)]
    return subprocess.run(
        [*pytest, *settings, *args],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_a_default_session_that_imports_torch_fails(tmp_path):
    (tmp_path / "test_fake.py").write_text(FAKE_TORCH)
    default = _pytest(tmp_path, "test_fake.py")
    assert default.returncode == 1, default.stdout
    assert "1 passed, 1 deselected" in default.stdout
    assert "FAILED (session): the default (not slow) tests imported torch" in default.stdout
    # A session that runs slow tests may import it (they compare with transformers live).
    slow = _pytest(tmp_path, "test_fake.py", "-m", "slow")
    assert slow.returncode == 0, slow.stdout
    assert "1 passed, 1 deselected" in slow.stdout and "FAILED (session)" not in slow.stdout
