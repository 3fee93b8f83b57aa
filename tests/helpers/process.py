"""Child processes as a user starts them: `python run_training.py ...`, `python -m meshtrain.X`,
`python -m meshtrain.launch ...`, each with its own faked CPU device count.

A child runs in a fresh temporary directory unless told otherwise (`scratch_dir`), never in the
checkout: a run without `hydra.run.dir` makes Hydra's `outputs/` (or `multirun/`) in its working
directory, and tests/conftest.py fails the session if the checkout gains either.

Imports nothing but the standard library (and helpers.paths and meshtrain.distributed.xla_flags):
tests/conftest.py reads FAST_COMPILE from here before it sets up JAX's environment.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from helpers.paths import REPO
from meshtrain.distributed.xla_flags import with_cpu_collective_timeouts

if TYPE_CHECKING:
    import helpers.commands

# The tests compile far more than they compute: without XLA's expensive CPU optimisations the
# compiles take half the time (the losses agree to the digits the docs print). Both sides of
# every comparison run with the same flags.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
RUN_TRAINING = REPO / "run_training.py"


def subprocess_env(num_devices: int = 8) -> dict[str, str]:
    """Environment for a child `python run_training.py`: its own faked device count."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = with_cpu_collective_timeouts(
        f"{FAST_COMPILE} --xla_force_host_platform_device_count={num_devices}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


@functools.cache
def _scratch_root() -> Path:
    """This process's directory of scratch working directories, removed when it exits."""
    root = Path(tempfile.mkdtemp(prefix="meshtrain-test-cwd-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def scratch_dir() -> Path:
    """A new directory to run a child in, so that what it writes relative to its working
    directory (Hydra's `outputs/` and `multirun/`) lands there and not in the checkout. The
    inputs the docs name by relative path (examples/, tests/fixtures/) are linked in, read-only
    in spirit, so a documented command runs there as written from the repository's root."""
    directory = Path(tempfile.mkdtemp(dir=_scratch_root()))
    (directory / "examples").symlink_to(REPO / "examples")
    (directory / "tests").mkdir()
    (directory / "tests" / "fixtures").symlink_to(REPO / "tests" / "fixtures")
    return directory


def run_python(
    *args: str | Path,
    devices: int = 8,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """`python <args>` to its end, output captured; `env` (else subprocess_env(devices)); in
    `cwd` (else a scratch_dir: give scripts by absolute path, e.g. REPO / "run_training.py")."""
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=scratch_dir() if cwd is None else cwd,
        env=subprocess_env(devices) if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_training(
    *args: str,
    devices: int = 8,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python run_training.py <args>`, as the README runs it, from a scratch_dir: a run
    without `hydra.run.dir` lands in that directory's `outputs/`, not in the checkout's."""
    return run_python(RUN_TRAINING, *args, devices=devices, env=env, timeout=timeout)


def launcher(*args: str) -> list[str]:
    """The command line of `python -m meshtrain.launch <args>` (for subprocess.Popen)."""
    return [sys.executable, "-m", "meshtrain.launch", *args]


def run_launcher(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    """`python -m meshtrain.launch <args>` to its end; keywords as for run_python."""
    return run_python("-m", "meshtrain.launch", *args, **kwargs)


def assert_one_line_error(
    result: subprocess.CompletedProcess | helpers.commands.CommandResult, expected: str
) -> None:
    """Exit code 2 and one `meshtrain: error: ...` line holding `expected`, last, no traceback:
    of a child process, or of a command run in this process (helpers.commands)."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert lines[-1].startswith("meshtrain: error: ")
    assert expected in lines[-1], lines[-1]
    assert not any(line.startswith("meshtrain: error") for line in lines[:-1])


def torchrun(*args: str) -> list[str]:
    """The command line of the real `torchrun <args>` (torch's, from the parity extra), for
    subprocess.Popen; `python -m torch.distributed.run` where no torchrun script is installed."""
    script = Path(sys.executable).parent / "torchrun"
    if script.is_file():
        return [str(script), *args]
    return [sys.executable, "-m", "torch.distributed.run", *args]
