"""`run_training.py` under the real torchrun (torch's, from the `parity` extra): the design docs'
commands on one machine and on two (two agents on loopback), a killed process, a restart, and
the elastic node count meshtrain refuses. Faked CPU devices, gloo collectives."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import numpy as np
import pytest
from helpers.one_process import CONSTANT_RUN, REFERENCE_STEPS, one_device_losses
from helpers.paths import REPO
from helpers.process import subprocess_env, torchrun
from helpers.runs import losses

from meshtrain.checkpoint import committed_steps
from meshtrain.distributed.launcher import free_port

ENTRY = str(REPO / "run_training.py")
pytestmark = [
    # torchrun is torch's: skipped where the parity extra is missing. Looked up, not imported:
    # this process never needs torch (tests/conftest.py checks that the default set imports none).
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (parity)"),
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc"),
]


def torchrun_ports() -> int:
    """A free MASTER_PORT whose next port, meshtrain's coordinator under torchrun, is free too."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def start(command: list[str], cwd: Path, devices: int, out: Path) -> subprocess.Popen:
    """A command with `devices` faked CPU devices per process, its output into `out`; with
    OMP_NUM_THREADS=1, as docs/multi-node.md exports it (torchrun's own value, without its
    banner)."""
    env = subprocess_env(devices)
    env.pop("MESHTRAIN_RUN_ID", None)
    env["OMP_NUM_THREADS"] = "1"
    with out.open("w") as sink:
        return subprocess.Popen(
            command, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True
        )


def children(pid: int) -> dict[int, list[bytes]]:
    """pid → environment of each child of process `pid` (torchrun's workers, each in its own
    session, so that no signal to the agent's process group reaches them)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid:
                found[int(entry.name)] = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
    return found


def stop(*procs: subprocess.Popen) -> None:
    """Ends what still runs of `procs` and of their children (after a failed assertion)."""
    for proc in procs:
        if proc.poll() is None:
            for pid in children(proc.pid):
                with suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()


def finish(*procs: subprocess.Popen, timeout: float = 900) -> list[int]:
    """The exit codes, waiting up to `timeout` seconds for each; then nothing runs any more."""
    try:
        return [proc.wait(timeout=timeout) for proc in procs]
    finally:
        stop(*procs)


def nodes(port: int, per_node: int, *args: str) -> list[list[str]]:
    """The design docs' two-machine torchrun commands, both machines on 127.0.0.1."""
    return [
        torchrun(
            *(option.format(rank=rank, addr="127.0.0.1") for option in TWO_MACHINES[:2]),
            f"--nproc_per_node={per_node}",
            TWO_MACHINES[3].format(addr="127.0.0.1"),
            f"--master_port={port}",
            ENTRY,
            *args,
        )
        for rank in (0, 1)
    ]


# The commands of docs/multi-node.md#torchrun, which the tests below run (with a free port).
ONE_MACHINE = ("--nproc_per_node=4",)
ONE_MACHINE_MESH = 'model.mesh_shape=[[4,2],["fsdp","tp"]]'
TWO_MACHINES = ("--nnodes=2", "--node_rank={rank}", "--nproc_per_node=2", "--master_addr={addr}")
TWO_MACHINES_MESH = 'model.mesh_shape=[[2,2,2],["dp","fsdp","tp"]]'


def test_the_doc_shows_the_commands_tested_here():
    text = (REPO / "docs" / "multi-node.md").read_text()
    assert f"torchrun {' '.join(ONE_MACHINE)} run_training.py '{ONE_MACHINE_MESH}'" in text
    for rank in (0, 1):
        options = " ".join(TWO_MACHINES).format(rank=rank, addr="10.0.0.1")
        line = f"torchrun {options} --master_port=29500 run_training.py '{TWO_MACHINES_MESH}'"
        assert line in text
    assert "export XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu" in text


def only_run_dir(root: Path) -> Path:
    (run_dir,) = (root / "outputs" / "tiny").glob("*/*")
    return run_dir


@pytest.mark.slow
def test_the_design_docs_torchrun_command_matches_one_process(tmp_path):
    """`torchrun --nproc_per_node=4 run_training.py model.mesh_shape=...` as written: 4 processes
    × 2 devices, JAX's coordinator on MASTER_PORT+1, one run directory, and the losses of one
    process (helpers.one_process: on one device, as every mesh of one process)."""
    port = torchrun_ports()
    args = (ONE_MACHINE_MESH, *CONSTANT_RUN)
    (tmp_path / "torchrun").mkdir()
    agent = start(
        torchrun(*ONE_MACHINE, f"--master_port={port}", ENTRY, *args),
        tmp_path / "torchrun",
        2,
        tmp_path / "torchrun.txt",
    )
    try:  # the reference, in this process, while they run
        want = one_device_losses(3)
    except BaseException:
        stop(agent)
        raise
    assert finish(agent) == [0], (tmp_path / "torchrun.txt").read_text()[-3000:]
    # Quiet as meshtrain.launch: no Gloo line from the processes, no banner from torchrun.
    output = (tmp_path / "torchrun.txt").read_text()
    assert "[Gloo]" not in output and "Setting OMP_NUM_THREADS" not in output, output[-3000:]
    run_dir = only_run_dir(tmp_path / "torchrun")
    got = losses(run_dir / "metrics.jsonl")
    assert len(got) == 3
    np.testing.assert_allclose(got, want, rtol=1e-5)
    main_log = (run_dir / "train.log").read_text()
    assert (
        "process 0 of 4 joined through the torchrun agent (MASTER_ADDR, RANK, WORLD_SIZE, "
        f"LOCAL_RANK) (coordinator 127.0.0.1:{port + 1}: MASTER_PORT+1, since torchrun's agent "
        f"holds MASTER_PORT={port} for its own store); local devices: 2 devices (cpu)"
    ) in main_log
    assert "on 8 cpu device(s), 4 process(es)" in main_log
    assert {f"rank{r}.log" for r in (1, 2, 3)} <= {p.name for p in run_dir.iterdir()}


@pytest.mark.slow
def test_two_torchrun_agents_as_two_machines_match_one_process(tmp_path):
    """The two-machine command, both agents on loopback: --nnodes=2, 2 processes × 2 devices per
    machine, a dp axis; ranks from torchrun, one run directory, the losses of one process."""
    port = torchrun_ports()
    args = (TWO_MACHINES_MESH, *CONSTANT_RUN)
    (tmp_path / "torchrun").mkdir()
    machines = [
        start(command, tmp_path / "torchrun", 2, tmp_path / f"node{rank}.txt")
        for rank, command in enumerate(nodes(port, 2, *args))
    ]
    try:  # the reference, in this process, while they run
        want = one_device_losses(3)
    except BaseException:
        stop(*machines)
        raise
    assert finish(*machines) == [0, 0], (tmp_path / "node1.txt").read_text()[-3000:]
    run_dir = only_run_dir(tmp_path / "torchrun")  # the second machine's own is gone
    np.testing.assert_allclose(losses(run_dir / "metrics.jsonl"), want, rtol=1e-5)
    assert "on 8 cpu device(s), 4 process(es)" in (run_dir / "train.log").read_text()
    # The second machine's processes: RANK 2 and 3 from torchrun, LOCAL_RANK 0 and 1.
    for rank in (2, 3):
        assert (
            f"process {rank} of 4 joined through the torchrun agent"
            in (run_dir / f"rank{rank}.log").read_text()
        )


def worker_pid(agent: subprocess.Popen, rank: int) -> int | None:
    """The pid of the process torchrun's agent `agent` started with RANK=`rank`, if any."""
    found = [pid for pid, env in children(agent.pid).items() if f"RANK={rank}".encode() in env]
    return found[0] if found else None


def kill_after_a_checkpoint(agent: subprocess.Popen, rank: int, run_dir: Path, out: Path) -> int:
    """Waits for a committed checkpoint and a step after it, then SIGKILLs process `rank` (a
    child of `agent`); returns the step of the newest checkpoint seen before the kill."""
    deadline = time.monotonic() + 600
    metrics = run_dir / "metrics.jsonl"
    while True:
        assert agent.poll() is None, out.read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 600 s"
        saved = (
            committed_steps(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else []
        )
        logged = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if saved and logged > max(saved):
            pid = worker_pid(agent, rank)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                return max(saved)
        time.sleep(0.1)


def steps_and_losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(row["step"], row["loss"]) for row in map(json.loads, lines)]


# A constant learning rate after warmup: a longer or shorter run follows the same losses.
RESUMABLE = (
    'model.mesh_shape=[[4,1],["fsdp","tp"]]',
    *CONSTANT_RUN,
    "checkpoint.every_steps=2",
    "distributed.timeout_s=60",
)


def reference_losses(steps: int) -> dict[int, float]:
    """Step → loss of steps 1..steps of an uninterrupted run of this shape (helpers.one_process:
    CONSTANT_RUN on one device, run in this process once for every test)."""
    return dict(enumerate(one_device_losses(steps), start=1))


@pytest.mark.slow
def test_a_killed_process_stops_both_machines_and_the_run_resumes(tmp_path):
    """Two agents (--nnodes=2, 1 process × 2 devices each). The second machine's process is
    killed: the first machine's process hears it through the roll call's connection and stops
    at once (torchrun's agents know nothing of each other), both agents end. A second launch
    resumes from the newest checkpoint with the losses of an uninterrupted run."""
    port, run_dir = torchrun_ports(), tmp_path / "run"
    first = [*RESUMABLE, "training.steps=100000", f"hydra.run.dir={run_dir}"]
    outs = [tmp_path / f"node{rank}.txt" for rank in (0, 1)]
    machines = [
        start(command, tmp_path, 2, outs[rank])
        for rank, command in enumerate(nodes(port, 1, *first))
    ]
    try:
        kill_after_a_checkpoint(machines[1], 1, run_dir, outs[1])
    finally:
        killed_at = time.monotonic()
        codes = finish(*machines, timeout=90)
    assert time.monotonic() - killed_at < 30  # no hang: JAX's heartbeat would take 60 s
    assert codes[0] != 0 and codes[1] != 0
    assert (
        f"meshtrain: error: process 1 (on {os.uname().nodename}) ended without a word"
        in outs[0].read_text()
    )
    newest = max(committed_steps(run_dir / "checkpoints"))
    steps = newest + 2
    port = torchrun_ports()
    second = [*RESUMABLE, f"training.steps={steps}", f"hydra.run.dir={run_dir}"]
    machines = [
        start(command, tmp_path, 2, tmp_path / f"again{rank}.txt")
        for rank, command in enumerate(nodes(port, 1, *second))
    ]
    try:  # the uninterrupted run, in this process (or already made), while they run
        want = reference_losses(steps)
    except BaseException:
        stop(*machines)
        raise
    assert finish(*machines) == [0, 0], (tmp_path / "again0.txt").read_text()[-3000:]
    assert (
        f"resuming from {run_dir / 'checkpoints' / str(newest)} at step {newest}"
        in (run_dir / "train.log").read_text()
    )
    resumed = steps_and_losses(run_dir)[-2:]  # the second launch's steps
    assert [step for step, _ in resumed] == [newest + 1, newest + 2]
    np.testing.assert_allclose(
        [loss for _, loss in resumed], [want[s] for s, _ in resumed], rtol=1e-5
    )


@pytest.mark.slow
def test_a_restarted_group_resumes_from_the_newest_checkpoint(tmp_path):
    """`torchrun --max-restarts=1`: a killed process makes torchrun restart the group; the new
    processes continue in the first start's run directory (no fixed hydra.run.dir needed) from
    its newest checkpoint, and the run ends with the losses of an uninterrupted one."""
    port, steps = torchrun_ports(), REFERENCE_STEPS
    args = [*RESUMABLE, f"training.steps={steps}"]
    out = tmp_path / "torchrun.txt"
    (tmp_path / "torchrun").mkdir()
    agent = start(
        torchrun("--nproc_per_node=2", "--max-restarts=1", f"--master_port={port}", ENTRY, *args),
        tmp_path / "torchrun",
        2,
        out,
    )
    try:
        deadline = time.monotonic() + 600
        while not list((tmp_path / "torchrun" / "outputs" / "tiny").glob("*/*/train.log")):
            assert agent.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        (train_log,) = (tmp_path / "torchrun" / "outputs" / "tiny").glob("*/*/train.log")
        kill_after_a_checkpoint(agent, 1, train_log.parent, out)
        want = reference_losses(steps)  # in this process, while the restarted group trains
        assert finish(agent) == [0], out.read_text()[-3000:]
    finally:
        stop(agent)
        for record in Path(tempfile.gettempdir()).glob(f"meshtrain-torchrun-{agent.pid}-*"):
            record.unlink()
    run_dir = only_run_dir(tmp_path / "torchrun")  # the restarted processes' own is gone
    log_text = (run_dir / "train.log").read_text()
    assert "torchrun restarted the processes (restart 1 of at most 1)" in log_text
    assert "resuming from" in log_text
    got = dict(steps_and_losses(run_dir))  # the last value of each step: after the restart
    assert sorted(got) == list(range(1, steps + 1))
    np.testing.assert_allclose(
        [got[s] for s in sorted(got)], [want[s] for s in sorted(got)], rtol=1e-5
    )


def test_an_elastic_node_count_is_one_line_error(tmp_path):
    """`--nnodes=1:2` (elastic, c10d rendezvous): the process refuses it before JAX starts."""
    port = torchrun_ports()
    out = tmp_path / "out.txt"
    agent = start(
        torchrun(
            "--nnodes=1:2",
            "--nproc_per_node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-conf=last_call_timeout=1",
            ENTRY,
            "data=synthetic",
            f"hydra.run.dir={tmp_path / 'run'}",
        ),
        tmp_path,
        2,
        out,
    )
    assert finish(agent, timeout=300) == [1]
    errors = [line for line in out.read_text().splitlines() if line.startswith("meshtrain: ")]
    assert errors == [
        "meshtrain: error: torchrun --nnodes=1:2 asks for an elastic number of machines, which "
        "meshtrain cannot follow (the mesh and each process's share of the batch are fixed at "
        "start-up); give a fixed count, e.g. --nnodes=2 (with --max-restarts, a restarted group "
        "resumes from the newest checkpoint)"
    ]
    assert "exitcode  : 2" in out.read_text()  # torchrun's summary: the process's exit code
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.log"))
