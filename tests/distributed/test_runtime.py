"""Joining a multi-process run from torchrun-style variables; missing, dead and mismatched
processes end the others with a message that names them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from helpers.commands import train_command
from helpers.one_process import CONSTANT_RUN, one_device_losses
from helpers.paths import REPO
from helpers.process import launcher, subprocess_env
from helpers.runs import losses

from meshtrain.distributed.launcher import free_port
from meshtrain.distributed.runtime import check_devices, first_start_run_dir
from meshtrain.errors import DistributedError

ENTRY = str(REPO / "run_training.py")


class FakeDevice:
    def __init__(self, process_index: int, kind: str, platform: str = "gpu") -> None:
        self.process_index, self.device_kind, self.platform = process_index, kind, platform


def test_same_devices_everywhere_passes():
    check_devices([FakeDevice(p, "NVIDIA H100 80GB HBM3") for p in (0, 0, 1, 1)])


def test_mismatched_device_kinds_are_named():
    devices = [FakeDevice(0, "NVIDIA H100 80GB HBM3"), FakeDevice(1, "NVIDIA A100-SXM4-40GB")]
    with pytest.raises(DistributedError) as err:
        check_devices(devices)
    assert str(err.value) == (
        "the processes have different devices: process 0 has 1 device (NVIDIA H100 80GB HBM3), "
        "process 1 has 1 device (NVIDIA A100-SXM4-40GB); give every process the same number and "
        "kind of devices (--devices-per-process, CUDA_VISIBLE_DEVICES or "
        "distributed.local_device_ids)"
    )


def test_mismatched_device_counts_are_named():
    devices = [FakeDevice(p, "cpu", "cpu") for p in (0, 0, 0, 0, 1, 1, 2, 2, 2, 2)]
    with pytest.raises(DistributedError) as err:
        check_devices(devices)
    assert "process 0 has 4 devices (cpu), process 1 has 2 devices (cpu)" in str(err.value)


def torchrun_env(rank: int, world: int, port: int, devices: int = 1) -> dict[str, str]:
    env = subprocess_env(devices)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MESHTRAIN_RUN_ID="torchrun",
    )
    return env


def start(rank: int, world: int, port: int, log: Path, *args: str) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, ENTRY, *args],
            cwd=REPO,
            env=torchrun_env(rank, world, port, devices=2),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


@pytest.mark.slow  # two processes start and train
def test_a_process_killed_mid_run_ends_the_others(tmp_path):
    """Two processes started by hand with torchrun-style variables train together; when one
    is killed, the other stops at once with a message that names it, without waiting for the
    heartbeat timeout (60 s here). (2 × 2 devices on [[4,1]] with a constant learning rate:
    the program of test_runtime_torchrun.py's resumed runs, which process 0 finds compiled.)"""
    port, run_dir = free_port(), tmp_path / "run"
    args = (
        *CONSTANT_RUN,
        "model.mesh_shape=[[4,1],[fsdp,tp]]",
        "training.steps=100000",
        "distributed.timeout_s=60",
        f"hydra.run.dir={run_dir}",
    )
    logs = [tmp_path / f"out{rank}.txt" for rank in (0, 1)]
    first, second = (start(rank, 2, port, logs[rank], *args) for rank in (0, 1))
    try:
        deadline = time.monotonic() + 600
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert first.poll() is None and second.poll() is None, logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "no training step within 600 s"
            time.sleep(0.2)
        second.kill()
        code = first.wait(timeout=60)  # the others must not hang
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
    output = logs[0].read_text()
    assert code == 1, output[-3000:]
    assert output.strip().splitlines()[-1] == (
        f"meshtrain: error: process 1 (on {os.uname().nodename}) ended without a word: killed, "
        "out of memory or crashed inside JAX; see its output (or rank1.log in the run "
        "directory); stopping process 0 too"
    )
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines[:2]] == [1, 2]
    assert (
        "process 0 of 2 joined through the torchrun-style environment"
        in (run_dir / "train.log").read_text()
    )
    assert "process 1 of 2 joined" in (run_dir / "rank1.log").read_text()


def slurm_env(task: int, tasks: int, port: int, devices: int = 1) -> dict[str, str]:
    """What srun sets for a task on one node (localhost); JAX_COORDINATOR_PORT picks a free port
    instead of JAX's port from the job id."""
    env = subprocess_env(devices)
    env.update(
        SLURM_JOB_ID="4242",
        SLURM_STEP_NODELIST="localhost",
        SLURM_NTASKS=str(tasks),
        SLURM_PROCID=str(task),
        SLURM_LOCALID=str(task),
        JAX_COORDINATOR_PORT=str(port),
    )
    return env


@pytest.mark.slow
def test_a_process_that_never_arrives_is_named(tmp_path):
    """Process 0 of 2 waits for process 1, which never comes: the roll call names it after
    distributed.timeout_s, with torchrun-style variables and under SLURM (srun's variables)."""
    args = (ENTRY, "data=synthetic", "distributed.timeout_s=3", f"hydra.run.dir={tmp_path}")
    ports = [free_port(), free_port()]
    envs = [torchrun_env(0, 2, ports[0]), slurm_env(0, 2, ports[1])]
    procs = [
        subprocess.Popen(
            [sys.executable, *args], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
        )
        for env in envs
    ]
    outputs = [proc.communicate(timeout=120)[1] for proc in procs]
    last = [output.strip().splitlines()[-1] for output in outputs]
    assert [proc.returncode for proc in procs] == [1, 1], last
    assert last == [
        f"meshtrain: error: process 1 of 2 did not check in with process 0 at {host}:{port} "
        "within distributed.timeout_s=3s: not started, crashed before joining, or unable to reach "
        "that address (wrong coordinator address, firewall); see their logs"
        for host, port in zip(("127.0.0.1", "localhost"), ports, strict=True)
    ]


def test_inconsistent_torchrun_variables_are_one_line_and_exit_code_2(tmp_path):
    torchrun = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RANK="2", WORLD_SIZE="2")
    with mock.patch.dict(os.environ, torchrun):
        result = train_command("data=synthetic", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "meshtrain: error: RANK=2 is not below WORLD_SIZE=2; RANK numbers the processes 0..1 "
        "(WORLD_SIZE counts processes, not devices)"
    ]


@pytest.mark.slow
def test_the_design_docs_two_machine_example(tmp_path):
    """Two launchers as on two machines (here both on 127.0.0.1): WORLD_SIZE=4 processes,
    RANK=0 on the first and RANK=2 (its first process) on the second, each launcher with its
    own clock (MESHTRAIN_RUN_ID). The run lands in process 0's directory only, and gives the
    losses of one process (helpers.one_process: on one device, as every mesh of one process)."""
    port = free_port()
    mesh = ("model.mesh_shape=[[8,1],[fsdp,tp]]", *CONSTANT_RUN)
    machines = []
    for first_rank, run_id in ((0, "machine-1-clock"), (2, "machine-2-clock")):
        env = subprocess_env(1)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(first_rank),
            WORLD_SIZE="4",
            MESHTRAIN_RUN_ID=run_id,
        )
        machines.append(
            subprocess.Popen(
                launcher("--nprocs", "2", "--devices-per-process", "2", ENTRY, *mesh),
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:  # the reference, in this process, while they run (or already made)
        reference = one_device_losses(3)
    except BaseException:
        for machine in machines:
            machine.kill()
        raise
    finally:
        outputs = [machine.communicate(timeout=900) for machine in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs[1][1][-3000:]
    # The second launcher starts ranks 2 and 3; ranks other than 0 print nothing of their own
    # (their Gloo connection lines are hidden and counted), but each writes its rank log below.
    assert "ranks 2..3 of 4" in outputs[1][1]
    # One run directory: process 0's; the second machine's own (empty) one is gone.
    assert [p.name for p in (tmp_path / "outputs" / "tiny").iterdir()] == ["machine-1-clock"]
    run_dir = tmp_path / "outputs" / "tiny" / "machine-1-clock"
    assert {"rank1.log", "rank2.log", "rank3.log", "train.log"} <= {
        p.name for p in run_dir.iterdir()
    }
    np.testing.assert_allclose(losses(run_dir / "metrics.jsonl"), reference, rtol=1e-5)


@pytest.mark.slow
def test_a_slurm_job_matches_one_process(tmp_path):
    """Two SLURM tasks (srun's variables, faked on localhost) train together through JAX's own
    cluster detection and give the losses of one process (helpers.one_process). The mesh of
    docs/multi-node.md's srun example, [[8,1]]: process 0 finds test_launcher.py's program of it
    compiled."""
    mesh = ("model.mesh_shape=[[8,1],[fsdp,tp]]", *CONSTANT_RUN)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, ENTRY, *mesh, f"hydra.run.dir={tmp_path / 'slurm'}"],
            cwd=REPO,
            env=slurm_env(task, 2, port, devices=4),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for task in (0, 1)
    ]
    try:  # the reference, in this process, while they run (or already made)
        reference = one_device_losses(3)
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    finally:
        outputs = [proc.communicate(timeout=600) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs[0][1][-3000:]
    assert (
        "process 0 of 2 joined through the slurm cluster"
        in (tmp_path / "slurm" / "train.log").read_text()
    )
    np.testing.assert_allclose(losses(tmp_path / "slurm" / "metrics.jsonl"), reference, rtol=1e-5)


def test_a_torchrun_restart_continues_in_the_first_start_s_run_dir(tmp_path):
    """Process 0 of a group torchrun restarted (--max-restarts) takes the directory of the first
    start, where the checkpoints are, and removes the one Hydra made for it (only `.hydra/`)."""
    run_id = f"test-{time.monotonic_ns()}"
    first, again = tmp_path / "12-00-00", tmp_path / "12-00-30"
    (first / "checkpoints").mkdir(parents=True)
    (again / ".hydra").mkdir(parents=True)
    (again / ".hydra" / "config.yaml").write_text("{}")
    environ = {"TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_MAX_RESTARTS": "3"}
    record = Path(tempfile.gettempdir()) / f"meshtrain-torchrun-{os.getppid()}-{run_id}.run_dir"
    try:
        assert first_start_run_dir(first, {**environ, "TORCHELASTIC_RESTART_COUNT": "0"}) == first
        assert first_start_run_dir(again, {**environ, "TORCHELASTIC_RESTART_COUNT": "1"}) == first
        assert not again.exists() and first.is_dir()
    finally:
        record.unlink(missing_ok=True)
    # Without --max-restarts (or torchrun) nothing is recorded or moved.
    assert first_start_run_dir(again, {"TORCHELASTIC_RESTART_COUNT": "1"}) == again
