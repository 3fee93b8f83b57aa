"""The session's own checks (tests/conftest.py, helpers.guards): the tests write nothing into the
checkout's outputs/ or multirun/, and a session of the default tests imports no torch."""

import os
import subprocess
import sys

from helpers.guards import changes, checkout_message, heavy_import_message, heavy_imports, snapshot
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


def test_the_message_names_the_paths_in_the_checkout():
    changed = [f"outputs/run{i:02}" for i in range(12)]
    message = checkout_message(changed)
    assert message.startswith(f"the tests wrote into the checkout: {REPO}/outputs/run00, ")
    assert f"{REPO}/outputs/run09 and 2 more appeared" in message
    assert "run10" not in message and "hydra.run.dir" in message


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
