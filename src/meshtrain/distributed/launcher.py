"""Runs the processes of one training run on this machine; its command line is
`python -m meshtrain.launch` (meshtrain.cli.launch).

    python -m meshtrain.launch --nprocs N [--devices-per-process K] run_training.py [overrides...]

Each process gets torchrun-style variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE), its own K devices (K faked CPU devices, or K of the machine's
GPUs) and MESHTRAIN_RUN_ID, so that all processes write into one run directory. Every output
line is prefixed with `[rank R]`. When a process fails, the others are stopped and the launcher
exits with the exit code of the first to fail (ExitOrder), not of those that failed after it.

Alone, it runs a whole job on this machine (coordinator 127.0.0.1, a free port). On several
machines, run it on each with the same MASTER_ADDR (the first machine's address), MASTER_PORT
and WORLD_SIZE (the number of processes on all machines together), and RANK set to the global
rank of this machine's first process: 0 on the first machine, then the sum of the --nprocs of
the machines before it (RANK=4 on the second of two machines with --nprocs 4).
"""

from __future__ import annotations

import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import BinaryIO

from meshtrain.distributed.environment import RUN_ID_VAR, TORCHRUN_VARS, env_int
from meshtrain.distributed.quiet_output import FILTERED_VAR, ChatterLines
from meshtrain.distributed.xla_flags import (
    with_cpu_collective_timeouts,
    without_fake_device_count,
)
from meshtrain.errors import ConfigError


@dataclass(frozen=True)
class NodeRanks:
    """Where this machine's processes sit in the whole run."""

    master_addr: str
    master_port: int
    first_rank: int  # global rank of this machine's first process
    world_size: int  # processes on all machines


def node_ranks(nprocs: int, environ: Mapping[str, str]) -> NodeRanks:
    """The whole run on this machine, or this machine's share of a run whose MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE and RANK (this machine's first rank) are in the environment."""
    given = [name for name in TORCHRUN_VARS if environ.get(name, "") != ""]
    if not given:
        return NodeRanks("127.0.0.1", free_port(), 0, nprocs)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE") if name not in given]
    if missing:
        raise ConfigError(
            f"{', '.join(given)} set but {', '.join(missing)} not: on several machines set "
            "MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK on each (see docs/multi-node.md), "
            "or none of them to run everything on this machine"
        )
    port = env_int(environ, "MASTER_PORT", minimum=1)
    if port > 65535:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port; use one in 1..65535, e.g. 29500")
    world = env_int(environ, "WORLD_SIZE", minimum=1)
    if "RANK" in given:
        first = env_int(environ, "RANK")
    elif world == nprocs:
        first = 0
    else:
        raise ConfigError(
            f"RANK is not set but WORLD_SIZE={world} is more than --nprocs {nprocs}: set RANK to "
            "the global rank of this machine's first process (0 on the first machine, then the "
            "sum of --nprocs of the machines before)"
        )
    if first + nprocs > world:
        raise ConfigError(
            f"RANK={first} + --nprocs {nprocs} is more than WORLD_SIZE={world}: this machine would "
            f"run ranks {first}..{first + nprocs - 1}, but ranks stop at {world - 1}; RANK is the "
            "first rank on this machine and WORLD_SIZE the number of processes on all machines"
        )
    return NodeRanks(environ["MASTER_ADDR"], port, first, world)


def free_port() -> int:
    """A TCP port nothing listens on right now (the coordinator binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def count_gpus(environ: Mapping[str, str]) -> int:
    """Visible NVIDIA GPUs: CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`; 0 without."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([g for g in visible.split(",") if g.strip() and g.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.splitlines())


def choose_platform(requested: str, needed: int, environ: Mapping[str, str]) -> str:
    """ "cpu" or "gpu"; with "auto", GPUs when the machine has any."""
    if requested == "cpu":
        return "cpu"
    gpus = count_gpus(environ)
    if requested == "auto" and gpus == 0:
        return "cpu"
    if gpus < needed:
        raise ConfigError(
            f"{needed} GPUs needed (--nprocs × --devices-per-process) but {gpus} visible; "
            "lower --nprocs or --devices-per-process, or use --platform cpu for faked devices"
        )
    return "gpu"


def process_env(
    base: Mapping[str, str],
    node: NodeRanks,
    *,
    local_rank: int,
    nprocs: int,
    devices_per_process: int,
    platform: str,
    run_id: str,
) -> dict[str, str]:
    """The environment of this machine's process number `local_rank`."""
    env = dict(base)
    env.update(
        MASTER_ADDR=node.master_addr,
        MASTER_PORT=str(node.master_port),
        RANK=str(node.first_rank + local_rank),
        WORLD_SIZE=str(node.world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(nprocs),
        PYTHONUNBUFFERED="1",  # lines arrive as they are printed, not when a buffer fills
    )
    env[FILTERED_VAR] = "1"  # the launcher hides Gloo's lines (_Pump); the process need not
    env[RUN_ID_VAR] = run_id
    if platform == "cpu":
        flags = without_fake_device_count(env.get("XLA_FLAGS", ""))
        count = f"--xla_force_host_platform_device_count={devices_per_process}"
        env["XLA_FLAGS"] = with_cpu_collective_timeouts(f"{flags} {count}")
        env["JAX_PLATFORMS"] = "cpu"
    else:
        first = local_rank * devices_per_process
        ids = range(first, first + devices_per_process)
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(i) for i in ids)  # read by JAX itself
    return env


def describe_exit(code: int) -> str:
    """A child's return code in words, e.g. "was killed by SIGKILL (exit code 137)"."""
    if code >= 0:
        return f"exited with code {code}"
    names = {s.value: s.name for s in signal.Signals}
    return f"was killed by {names.get(-code, f'signal {-code}')} (exit code {128 - code})"


def shell_exit_code(code: int) -> int:
    """A child's return code as a shell reports it: 128 + N for a process killed by signal N."""
    return 128 - code if code < 0 else code


_OUTPUT = threading.Lock()  # whole lines, from the ranks' pumps and from the launcher itself


class _Pump:
    """Copies a child's output lines to ours whole, each with its rank prefix, under the lock of
    all output (_OUTPUT); without `verbose`, Gloo's connection chatter is dropped and counted."""

    def __init__(self, sink: BinaryIO, prefix: bytes, *, verbose: bool):
        self.sink, self.prefix, self.verbose = sink, prefix, verbose
        self.chatter = ChatterLines()

    @property
    def hidden(self) -> int:
        """Gloo reports dropped."""
        return self.chatter.dropped

    def run(self, source: BinaryIO) -> None:
        for line in iter(source.readline, b""):
            if not self.verbose:
                line = self.chatter.line(line if line.endswith(b"\n") else line + b"\n")
            if line:
                self._write(line)
        if not self.verbose and (rest := self.chatter.finish()).strip():
            self._write(rest)
        source.close()

    def _write(self, line: bytes) -> None:
        with _OUTPUT:
            self.sink.write(self.prefix + line.rstrip(b"\n") + b"\n")
            self.sink.flush()


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, frame: object) -> None:
    raise _Interrupted(signum)


class ExitOrder:
    """The watched processes' ends, in the order they happened: the kernel appends each pidfd to
    one epoll set's ready list the moment its process ends, and epoll reports them in that order
    however late the launcher looks. Without pidfds (not Linux), one thread per process waits for
    it: the order the threads wake in, the same unless two processes end within moments."""

    def __init__(self, *, use_pidfds: bool = True) -> None:
        self.processes: list[subprocess.Popen] = []
        try:  # pidfds: Linux 5.3 and later, unless a sandbox says no
            os.close(os.pidfd_open(os.getpid()))
            self._epoll = select.epoll() if use_pidfds else None
        except (AttributeError, OSError):
            self._epoll = None
        self._pidfds: dict[int, int] = {}  # pidfd → index in processes
        self._woken: queue.SimpleQueue[int] = queue.SimpleQueue()  # indexes, without pidfds

    def watch(self, process: subprocess.Popen) -> None:
        """Adds a process; right after it starts, so that even an instant end keeps its place."""
        index = len(self.processes)
        self.processes.append(process)
        if self._epoll is None:
            threading.Thread(target=self._wait, args=(index,), daemon=True).start()
            return
        pidfd = os.pidfd_open(process.pid)
        self._pidfds[pidfd] = index
        self._epoll.register(pidfd, select.EPOLLIN)

    def _wait(self, index: int) -> None:
        self.processes[index].wait()
        self._woken.put(index)

    def ended(self, timeout: float) -> list[int]:
        """Indexes of the processes that ended since the last call, earliest first (reaped, so
        their returncode is set); waits up to `timeout` seconds for one."""
        indexes: list[int] = []
        if self._epoll is None:
            with suppress(queue.Empty):
                indexes.append(self._woken.get(timeout=timeout))
                while True:
                    indexes.append(self._woken.get_nowait())
            return indexes
        for pidfd, _ in self._epoll.poll(timeout):
            self._epoll.unregister(pidfd)
            os.close(pidfd)
            indexes.append(self._pidfds.pop(pidfd))
            self.processes[indexes[-1]].wait()  # a zombie until reaped here
        return indexes

    def close(self) -> None:
        """Releases the pidfds and the epoll set (the waiter threads end with their processes)."""
        while self._pidfds:
            os.close(self._pidfds.popitem()[0])
        if self._epoll is not None:
            self._epoll.close()


def _stop(processes: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to the processes still running, SIGKILL to those still there after grace_s."""
    alive = [p for p in processes if p.poll() is None]
    for process in alive:
        process.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for process in alive:
        try:
            process.wait(timeout=max(end - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _say(message: str) -> None:
    with _OUTPUT:
        print(f"meshtrain.launch: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LaunchOptions:
    """What `python -m meshtrain.launch` was asked to run (meshtrain.cli.launch parses it)."""

    nprocs: int  # processes on this machine
    devices_per_process: int  # faked CPU devices, or GPUs, of each process
    platform: str  # auto, cpu or gpu
    grace_period: float  # seconds the others get to exit after SIGTERM when one fails
    verbose: bool  # also show Gloo's connection lines
    script: str  # the training script, e.g. run_training.py
    args: Sequence[str]  # its arguments (Hydra overrides)


def launch(args: LaunchOptions, environ: Mapping[str, str] | None = None) -> int:
    """Runs the processes and returns the exit code of the launcher."""
    environ = dict(os.environ if environ is None else environ)
    if not os.path.isfile(args.script):
        raise ConfigError(f"script {args.script!r} does not exist; e.g. run_training.py")
    node = node_ranks(args.nprocs, environ)
    platform = choose_platform(args.platform, args.nprocs * args.devices_per_process, environ)
    run_id = environ.get(RUN_ID_VAR) or time.strftime("%Y-%m-%d/%H-%M-%S")
    last = node.first_rank + args.nprocs - 1
    _say(
        f"ranks {node.first_rank}..{last} of {node.world_size}, coordinator "
        f"{node.master_addr}:{node.master_port}, {args.devices_per_process} {platform} "
        f"device(s) per process, {RUN_ID_VAR}={run_id}"
    )
    order = ExitOrder()
    pumps: list[_Pump] = []
    threads: list[threading.Thread] = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        for local_rank in range(args.nprocs):
            env = process_env(
                environ,
                node,
                local_rank=local_rank,
                nprocs=args.nprocs,
                devices_per_process=args.devices_per_process,
                platform=platform,
                run_id=run_id,
            )
            process = subprocess.Popen(
                [sys.executable, "-u", args.script, *args.args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            order.watch(process)
            prefix = f"[rank {node.first_rank + local_rank}] ".encode()
            for source, sink in (
                (process.stdout, sys.stdout.buffer),
                (process.stderr, sys.stderr.buffer),
            ):
                pump = _Pump(sink, prefix, verbose=args.verbose)
                thread = threading.Thread(target=pump.run, args=(source,), daemon=True)
                thread.start()
                pumps.append(pump)
                threads.append(thread)
        return supervise(order, node.first_rank, args.grace_period)
    except (KeyboardInterrupt, _Interrupted) as err:
        signum = err.signum if isinstance(err, _Interrupted) else signal.SIGINT
        _say(f"{signal.Signals(signum).name} received; stopping all processes")
        _stop(order.processes, args.grace_period)
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, previous)
        order.close()
        for thread in threads:
            thread.join(timeout=5)
        hidden = sum(pump.hidden for pump in pumps)
        if hidden:
            _say(f"hid {hidden} Gloo connection line(s); --verbose shows them")


def supervise(order: ExitOrder, first_rank: int, grace_s: float) -> int:
    """Waits for all processes; at the first failure (the earliest end with a nonzero code)
    stops the rest and returns that process's exit code, as a shell reports it."""
    running = set(range(len(order.processes)))
    while running:
        for index in order.ended(timeout=1.0):
            running.discard(index)
            code = order.processes[index].returncode
            if code != 0:
                _report_failure(order.processes, first_rank, index)
                _stop(order.processes, grace_s)
                return shell_exit_code(code)
    return 0


def _report_failure(processes: Sequence[subprocess.Popen], first_rank: int, index: int) -> None:
    """ "rank R was killed by SIGKILL (exit code 137); stopping ranks 0, 2" on stderr."""
    rest = [str(first_rank + i) for i, p in enumerate(processes) if p.poll() is None]
    _say(
        f"rank {first_rank + index} {describe_exit(processes[index].returncode)}"
        + (f"; stopping ranks {', '.join(rest)}" if rest else "")
    )
