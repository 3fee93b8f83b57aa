"""A command's `main()` run in this process, as its command line would run it: `sys.argv` set,
stdout and stderr captured, `SystemExit` turned into the exit code.

A child Python pays JAX's import, Hydra's set-up and a compile before it can print its one-line
error; here the command runs in the test's own process, where JAX is loaded and the programs it
compiled are cached. The subprocess smoke tests (tests/cli/test_entry_points.py and a few
others) keep proving the entry points, exit codes and output filters as a user meets them.

What a command changes in the process is put back afterwards: the loggers' handlers, levels
and propagation (Hydra and meshtrain set them up), `sys.argv`, the environment variables it
set and Hydra's global run config (HydraConfig). Hydra configures logging with
`logging.config.dictConfig`, which closes every handler the process has, pytest's own among
them: while a command runs here, that closing is skipped (`logging.config._clearExistingHandlers`),
and the handlers are put back afterwards instead.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import logging.config
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from unittest import mock

import jax

from helpers.paths import CONFIG_DIR


@dataclass(frozen=True)
class CommandResult:
    """What a finished command left: the same fields as subprocess.CompletedProcess's."""

    returncode: int
    stdout: str
    stderr: str


def _loggers() -> list[logging.Logger]:
    named = logging.Logger.manager.loggerDict.values()
    return [logging.getLogger(), *(x for x in named if isinstance(x, logging.Logger))]


@contextlib.contextmanager
def _restored_process_state() -> Iterator[None]:
    """Puts back the handlers, level and propagation of every logger that existed before (a
    logger first made by an import meanwhile keeps what its library gave it), sys.argv and
    os.environ."""
    from hydra.core.hydra_config import HydraConfig

    saved = {id(x): (x, list(x.handlers), x.level, x.propagate) for x in _loggers()}
    argv, environ = list(sys.argv), dict(os.environ)
    hydra_config = HydraConfig.instance().cfg
    try:
        with mock.patch.object(logging.config, "_clearExistingHandlers", lambda: None):
            yield
    finally:
        for logger, handlers, level, propagate in saved.values():
            for handler in logger.handlers:
                if handler not in handlers:
                    handler.close()
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate
        sys.argv[:] = argv
        os.environ.clear()
        os.environ.update(environ)
        HydraConfig.instance().cfg = hydra_config  # a Hydra run sets it for the whole process


@contextlib.contextmanager
def _visible_devices(count: int | None) -> Iterator[None]:
    """The command sees this process's first `count` devices (all of them if None), as a child
    started with XLA_FLAGS=--xla_force_host_platform_device_count=<count> would."""
    if count is None:
        yield
        return
    devices = jax.devices()[:count]
    with mock.patch.object(jax, "devices", lambda *backend: devices):
        yield


def run_main(
    main: Callable[[], None],
    *argv: str,
    prog: str,
    devices: int | None = None,
) -> CommandResult:
    """`main()` with `sys.argv = [prog, *argv]`, in this process, on its first `devices` devices;
    the exit code is what main() returned or passed to sys.exit."""
    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with (
        _restored_process_state(),
        _visible_devices(devices),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        sys.argv[:] = [prog, *argv]
        try:
            returned = main()
            code = returned if isinstance(returned, int) else 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
    return CommandResult(code, stdout.getvalue(), stderr.getvalue())


def train_command(*overrides: str, devices: int | None = None) -> CommandResult:
    """`python run_training.py <overrides>`, run in this process."""
    from meshtrain.cli.train import make_main

    return run_main(make_main(CONFIG_DIR), *overrides, prog="run_training.py", devices=devices)


def module_command(module: str, argv: Sequence[str], devices: int | None = None) -> CommandResult:
    """`python -m <module> <argv>` (meshtrain.generate, meshtrain.export, meshtrain.eval,
    meshtrain.data.prepare), run in this process through its cli's main()."""
    mains = {
        "meshtrain.generate": "meshtrain.cli.generate",
        "meshtrain.export": "meshtrain.cli.export",
        "meshtrain.eval": "meshtrain.cli.eval",
        "meshtrain.data.prepare": "meshtrain.cli.prepare",
    }
    main = importlib.import_module(mains[module]).main
    return run_main(main, *map(str, argv), prog=f"python -m {module}", devices=devices)
