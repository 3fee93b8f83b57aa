"""Joins this process to a multi-process run before any JAX backend use, and agrees on the run dir.

Start-up, in order: who this process is (`meshtrain.launch_env`), a roll call of all processes
(`meshtrain.rendezvous`), `jax.distributed.initialize`, a check that every process has the same
number and kind of devices, and process 0's run directory for everybody.

During the run, the roll call's connections carry failures: a process that fails tells the
others (`shared_failures`), one that dies closes its connection, and either way every process
stops at once, naming it. Behind that, JAX's coordination service ends all processes when one
stops sending heartbeats for `distributed.timeout_s` seconds (a machine that vanished).
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshtrain.config import DistributedConfig
from meshtrain.distributed.environment import (
    ProcessSpec,
    env_process_id,
    resolve_process_spec,
    torchrun_agent_argv,
)
from meshtrain.distributed.quiet_output import hide_gloo_chatter, restore_output
from meshtrain.distributed.rendezvous import SETTLE_S, Roster, roll_call
from meshtrain.errors import ConfigError, DistributedError, error_line
from meshtrain.observe.metrics import setup_logging

log = logging.getLogger(__name__)

# JAX's own timeouts get this much longer than ours, so that our message, not its abort, is seen.
_JAX_TIMEOUT_MARGIN_S = 10
_RUN_DIR_BYTES = 4096
_HOST_BYTES = 256
# How long a process whose step failed waits to hear that another process failed first.
_CONSEQUENCE_WAIT_S = 3.0


def _report(message: str) -> None:
    print(error_line(message), file=sys.stderr, flush=True)


@contextmanager
def deadline(seconds: float, message: str) -> Iterator[None]:
    """Ends this process with `message` if the block runs longer than `seconds`.

    The block may be stuck inside JAX's C++ code (waiting for another process), which no Python
    exception can interrupt; a timer thread can still report and exit.
    """

    def expire() -> None:
        _report(message)
        restore_output()
        os._exit(DistributedError.exit_code)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class _Membership:
    """This process's part in a multi-process run, as the exit path needs it."""

    active = False
    roster: Roster | None = None
    failed_code: int | None = None  # set when this process fails
    hosts: list[str] | None = None  # host name of each process, by process id


_membership = _Membership()


_stopping = threading.Lock()


def _stop_because(code: int, text: str) -> None:
    """Another process failed or died: report it and end this one (from the roster's thread, or
    from the main thread whose error was only a consequence)."""
    with _stopping:  # the first caller reports and exits; a second one waits for that
        _report(f"{text}; stopping process {_membership.roster.process_id} too")
        restore_output()  # flushes stdout, and the Gloo filter passes the rest on first
        os._exit(code)


def _leave() -> None:
    """At exit, before JAX's shutdown barrier (atexit runs the later registration first)."""
    if not _membership.active:
        return
    roster = _membership.roster
    if _membership.failed_code is None:
        if roster is not None:
            roster.say_done()
        return  # all processes meet in JAX's shutdown barrier
    if roster is not None and roster.process_id == 0:
        roster.wait_until_closed(SETTLE_S)  # the others hear of the failure before process 0 goes
    logging.shutdown()
    restore_output()  # flushes stdout, and the Gloo filter passes the rest on first
    sys.stderr.flush()
    os._exit(_membership.failed_code)


def _who(spec: ProcessSpec) -> str:
    return f"process {spec.process_id if spec.process_id is not None else env_process_id()}"


def initialize(
    cfg: DistributedConfig, environ: Mapping[str, str] | None = None
) -> ProcessSpec | None:
    """Starts jax.distributed for a multi-process run; None (and nothing done) for one process."""
    environ = os.environ if environ is None else environ
    spec = resolve_process_spec(cfg, environ, torchrun_agent_argv(environ))
    if spec is None or jax.distributed.is_initialized():  # Hydra multirun: joined already
        return spec
    if cfg.timeout_s < 1:
        raise ConfigError(f"distributed.timeout_s={cfg.timeout_s} must be at least 1, e.g. 300")
    # CPU devices of different processes talk through gloo over TCP (JAX's default has none).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Gloo prints a line per group it connects; meshtrain.launch hides them, and so does this
    # process where another launcher (torchrun, srun) started it.
    hide_gloo_chatter()
    # JAX logs its connection steps at INFO on the root logger (as "[HYDRA]" lines, through
    # Hydra's handler); join_run logs one line of its own instead.
    logging.getLogger("jax._src.distributed").setLevel(logging.WARNING)
    if spec.fully_known:
        roster = roll_call(
            spec.coordinator_address, spec.num_processes, spec.process_id, cfg.timeout_s
        )
        _membership.roster = roster
        roster.watch(_stop_because)
    _membership.active = True
    atexit.register(_leave)
    with deadline(
        cfg.timeout_s,
        f"{_who(spec)}: jax.distributed.initialize ({spec.source}) did not finish within "
        f"distributed.timeout_s={cfg.timeout_s}s: another process is missing or cannot reach "
        f"the coordinator {spec.coordinator_address or '(detected by JAX)'}",
    ):
        jax.distributed.initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            local_device_ids=spec.local_device_ids,
            cluster_detection_method=spec.cluster_detection,
            initialization_timeout=cfg.timeout_s + _JAX_TIMEOUT_MARGIN_S,
            heartbeat_timeout_seconds=cfg.timeout_s,
            shutdown_timeout_seconds=cfg.timeout_s,
        )
    # `kill -USR1 <pid>` prints every thread's Python stack: the first look at a rank that hangs.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return spec


def _describe_devices(devices: list[jax.Device]) -> str:
    kinds = sorted({d.platform if d.device_kind == d.platform else d.device_kind for d in devices})
    return f"{len(devices)} device{'s' if len(devices) != 1 else ''} ({', '.join(kinds)})"


def check_devices(devices: list[jax.Device]) -> None:
    """Every process has the same number and kind of devices (the mesh assumes it)."""
    by_process: dict[int, list[jax.Device]] = {}
    for device in devices:
        by_process.setdefault(device.process_index, []).append(device)
    shown = {p: _describe_devices(ds) for p, ds in sorted(by_process.items())}
    first = min(shown)
    differ = [p for p, text in shown.items() if text != shown[first]]
    if differ:
        raise DistributedError(
            f"the processes have different devices: process {first} has {shown[first]}, "
            f"process {differ[0]} has {shown[differ[0]]}"
            + (f" ({len(differ)} processes differ from process {first})" if len(differ) > 1 else "")
            + "; give every process the same number and kind of devices (--devices-per-process, "
            "CUDA_VISIBLE_DEVICES or distributed.local_device_ids)"
        )


def _to_bytes(text: str, size: int) -> np.ndarray:
    encoded = text.encode()
    if len(encoded) > size:
        raise ConfigError(f"{text!r} is longer than {size} bytes")
    buffer = np.zeros(size, np.uint8)  # [size], zero-padded
    buffer[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    return buffer


def _from_bytes(buffer: np.ndarray) -> str:
    return np.asarray(buffer, dtype=np.uint8).tobytes().rstrip(b"\0").decode()


def gather_hosts() -> list[str]:
    """The host name of every process, by process id (the same list on every process)."""
    table = multihost_utils.process_allgather(_to_bytes(socket.gethostname(), _HOST_BYTES))
    return [_from_bytes(row) for row in np.asarray(table)]  # [processes, bytes] → names


def process_hosts() -> list[str] | None:
    """Host name of each process, as gathered when the run was joined; None for one process."""
    return _membership.hosts


def agree_on_run_dir(run_dir: Path) -> Path:
    """Process 0's run directory, on every process.

    Another process's own directory (Hydra made it from its own clock) is removed if it is empty,
    so a multi-node launch leaves one run directory, not one per node.
    """
    own = run_dir.resolve()
    agreed = Path(
        _from_bytes(multihost_utils.broadcast_one_to_all(_to_bytes(str(own), _RUN_DIR_BYTES)))
    )
    if agreed != own:
        with suppress(OSError):  # not empty, or already gone: keep it
            own.rmdir()
    agreed.mkdir(parents=True, exist_ok=True)  # on a machine that does not share process 0's disk
    return agreed


def first_start_run_dir(run_dir: Path, environ: Mapping[str, str]) -> Path:
    """On process 0 under torchrun with --max-restarts: the run directory of the group's first
    start, so that a restarted group (its own clock gave it a new directory) resumes from the
    newest checkpoint there. The first start records its directory in a file named after
    torchrun's agent (this process's parent, which outlives the restarts)."""
    if int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) < 1:
        return run_dir
    run_id = re.sub(r"[^A-Za-z0-9_.-]", "_", environ.get("TORCHELASTIC_RUN_ID", ""))
    record = Path(tempfile.gettempdir()) / f"meshtrain-torchrun-{os.getppid()}-{run_id}.run_dir"
    own = run_dir.resolve()
    if int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0 or not record.is_file():
        with suppress(OSError):
            record.write_text(str(own))
        return run_dir
    first = Path(record.read_text())
    if (
        first != own
        and own.is_dir()
        and not any(not p.name.startswith(".hydra") for p in own.iterdir())
    ):
        shutil.rmtree(own, ignore_errors=True)  # only Hydra's copy of the same config
    return first


def join_run(cfg: DistributedConfig, run_dir: Path) -> Path:
    """Joins the other processes of a multi-process run, if any; returns the run directory to use.

    Call it before anything touches a JAX device.
    """
    spec = initialize(cfg)
    if spec is None:
        return run_dir
    with deadline(
        cfg.timeout_s,
        f"{_who(spec)}: the devices of all processes did not come up within distributed.timeout_s={cfg.timeout_s}s; "
        "check that every process sees the same kind of devices (all GPUs, or all CPUs)",
    ):
        devices = jax.devices()
        check_devices(devices)
        _membership.hosts = gather_hosts()
        if spec.process_id == 0:
            run_dir = first_start_run_dir(run_dir, os.environ)
        run_dir = agree_on_run_dir(run_dir)
    rank = jax.process_index()
    setup_logging(run_dir, is_main=rank == 0, rank=rank)
    origin = f": {spec.coordinator_origin}" if spec.coordinator_origin else ""
    log.info(
        "process %d of %d joined through the %s (coordinator %s%s); local devices: %s",
        rank,
        jax.process_count(),
        spec.source,
        spec.coordinator_address or "detected by JAX",
        origin,
        _describe_devices(jax.local_devices()),
    )
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restarts not in ("", "0"):
        log.info(
            "torchrun restarted the processes (restart %s of at most %s); continuing in %s",
            restarts,
            os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"),
            run_dir,
        )
    return run_dir


def _exit_code(err: BaseException) -> int:
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else 1
    if isinstance(err, KeyboardInterrupt):
        return 130
    return getattr(err, "exit_code", 1)


def _one_line(err: BaseException) -> str:
    if isinstance(err, (ConfigError, DistributedError)):
        return str(err)
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


@contextmanager
def shared_failures() -> Iterator[None]:
    """Tells the other processes when this one fails, and lets it exit without waiting for them.

    Without it a failing process would wait in JAX's shutdown barrier for processes that go on
    training, and those would block in their next collective until JAX's heartbeat timeout.
    """
    try:
        yield
    except BaseException as err:
        roster = _membership.roster
        if roster is not None and not isinstance(
            err, (ConfigError, DistributedError, SystemExit, KeyboardInterrupt)
        ):
            # A collective fails here at the moment another process dies; then that is the news.
            news = roster.wait_for_news(_CONSEQUENCE_WAIT_S)
            if news is not None:
                if roster.process_id == 0:
                    roster.wait_until_closed(SETTLE_S)
                _stop_because(*news)
        if _membership.active and _membership.failed_code is None:
            _membership.failed_code = _exit_code(err)
            if _membership.roster is not None:
                _membership.roster.say_failed(_membership.failed_code, _one_line(err))
        raise
