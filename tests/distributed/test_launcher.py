"""`python -m meshtrain.launch`: environment per process, [rank N] prefixes, fail-fast, and
2 processes × 4 devices giving the losses of one process on every mesh."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.commands import train_command
from helpers.one_process import CONSTANT_RUN, one_device_losses
from helpers.paths import REPO
from helpers.process import RUN_TRAINING, launcher, run_launcher, subprocess_env
from helpers.runs import losses

from meshtrain.checkpoint import committed_steps, read_meta
from meshtrain.distributed.launcher import (
    ExitOrder,
    NodeRanks,
    node_ranks,
    process_env,
    shell_exit_code,
    supervise,
)
from meshtrain.errors import ConfigError

# The sweep of docs/multi-node.md: fsdp across the two processes, and dp across them (fsdp and tp
# within). [[4,2]] (fsdp across processes, tp within): test_runtime_torchrun.py's 4 processes.
MESHES = ("[[8,1],[fsdp,tp]]", "[[2,2,2],[dp,fsdp,tp]]")


def test_node_ranks_alone_and_on_several_machines():
    alone = node_ranks(4, {})
    assert (alone.master_addr, alone.first_rank, alone.world_size) == ("127.0.0.1", 0, 4)
    # The design docs' second machine: RANK is its first process's rank.
    second = {"MASTER_ADDR": "192.168.1.10", "MASTER_PORT": "29500", "RANK": "4", "WORLD_SIZE": "8"}
    assert node_ranks(4, second) == NodeRanks("192.168.1.10", 29500, 4, 8)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "8", "RANK": "6"},
            "RANK=6 + --nprocs 4 is more than WORLD_SIZE=8: this machine would run ranks 6..9",
        ),
        (
            {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "8"},
            "RANK is not set but WORLD_SIZE=8 is more than --nprocs 4",
        ),
        (
            {"MASTER_ADDR": "h", "RANK": "4"},
            "MASTER_ADDR, RANK set but MASTER_PORT, WORLD_SIZE not",
        ),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "x", "WORLD_SIZE": "8"}, "MASTER_PORT='x' is not"),
    ],
)
def test_node_ranks_rejects_inconsistent_values(environ, message):
    with pytest.raises(ConfigError) as err:
        node_ranks(4, environ)
    assert message in str(err.value)


def test_process_env_sets_ranks_and_devices():
    plan = NodeRanks("10.0.0.1", 29500, 4, 8)
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x"}
    env = process_env(
        base, plan, local_rank=1, nprocs=4, devices_per_process=2, platform="cpu", run_id="r"
    )
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
    }
    assert env["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2 "
        "--xla_cpu_collective_call_warn_stuck_timeout_seconds=600 "
        "--xla_cpu_collective_call_terminate_timeout_seconds=86400 "
        "--xla_cpu_collective_timeout_seconds=86400"
    )
    mine = {"XLA_FLAGS": "--xla_cpu_collective_timeout_seconds=5"}  # the user's own value wins
    env = process_env(
        mine, plan, local_rank=0, nprocs=4, devices_per_process=2, platform="cpu", run_id="r"
    )
    assert env["XLA_FLAGS"].count("xla_cpu_collective_timeout_seconds") == 1
    assert "--xla_cpu_collective_timeout_seconds=5" in env["XLA_FLAGS"]
    assert (env["JAX_PLATFORMS"], env["MESHTRAIN_RUN_ID"]) == ("cpu", "r")
    gpu = process_env(
        {}, plan, local_rank=1, nprocs=4, devices_per_process=2, platform="gpu", run_id="r"
    )
    assert gpu["JAX_LOCAL_DEVICE_IDS"] == "2,3" and "XLA_FLAGS" not in gpu
    assert shell_exit_code(-9) == 137 and shell_exit_code(3) == 3


SCRIPT = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
print("env", rank, os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"],
      os.environ["MESHTRAIN_RUN_ID"], os.environ["XLA_FLAGS"].split()[0], sys.argv[1:], flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "gloo":  # Gloo's chatter: a line of its own, and one inside another line
    gloo = "[Gloo] Rank %d is connected to 2 peer ranks. Expected number of connected peer ranks is : 2"
    print(gloo % rank, file=sys.stderr, flush=True)
    print("half " + gloo % rank + "\\nline", file=sys.stderr, flush=True)
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode == "kill" and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
if mode not in ("ok", "gloo"):
    time.sleep(300)
"""


def run_script(tmp_path: Path, mode: str, *options: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    return run_launcher(
        *options,
        "--nprocs",
        "3",
        "--devices-per-process",
        "2",
        str(script),
        mode,
        "x=1",
        env={**subprocess_env(8), "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
        timeout=120,  # a launcher that does not stop the sleeping ranks fails here
    )


def test_launcher_prefixes_lines_and_sets_the_environment(tmp_path):
    result = run_script(tmp_path, "ok")
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if " env " in line)
    assert len(lines) == 3
    run_ids = set()
    for rank, line in enumerate(lines):
        prefix, _, rest = line.partition(" env ")
        assert prefix == f"[rank {rank}]"
        got_rank, local, world, addr, run_id, flags, args = rest.split(" ", 6)
        assert (got_rank, local, world, addr) == (str(rank), str(rank), "3", "127.0.0.1")
        assert flags == "--xla_force_host_platform_device_count=2"
        assert args == "['ok', 'x=1']"
        run_ids.add(run_id)
    assert len(run_ids) == 1  # one run directory for all
    ranked = sorted(line for line in result.stderr.splitlines() if line.startswith("[rank"))
    assert ranked == [f"[rank {r}] to stderr" for r in range(3)]
    assert result.stderr.startswith("meshtrain.launch: ranks 0..2 of 3, coordinator 127.0.0.1:")


def test_gloo_chatter_is_hidden_unless_verbose(tmp_path):
    quiet = run_script(tmp_path, "gloo")
    assert quiet.returncode == 0, quiet.stderr
    ranked = sorted(line for line in quiet.stderr.splitlines() if line.startswith("[rank"))
    assert ranked == sorted(
        f"[rank {r}] {text}" for r in range(3) for text in ("to stderr", "half line")
    )
    assert "[Gloo]" not in quiet.stderr
    assert quiet.stderr.splitlines()[-1] == (
        "meshtrain.launch: hid 6 Gloo connection line(s); --verbose shows them"
    )
    verbose = run_script(tmp_path, "gloo", "--verbose")
    assert verbose.returncode == 0, verbose.stderr
    assert verbose.stderr.count("[Gloo] Rank") == 6 and "hid " not in verbose.stderr


def test_launcher_stops_the_rest_and_returns_the_failing_exit_code(tmp_path):
    result = run_script(tmp_path, "fail")
    assert result.returncode == 3
    # The other ranks' own lines may still be pumped after the launcher's message.
    said = [line for line in result.stderr.splitlines() if line.startswith("meshtrain.launch:")]
    assert said[-1] == "meshtrain.launch: rank 1 exited with code 3; stopping ranks 0, 2"


def test_launcher_reports_a_killed_process(tmp_path):
    result = run_script(tmp_path, "kill")
    assert result.returncode == 137
    assert (
        "meshtrain.launch: rank 1 was killed by SIGKILL (exit code 137); stopping ranks 0, 2"
        in result.stderr
    )


# Two ranks joined by a pipe, as by their connections: the one that ends first (SIGKILL or exit
# 3, 0.1 s in) closes its end; the other reads that and exits 1 ("lost a peer") 10 ms later,
# inside one 0.1 s poll of a launcher that blamed the lowest failed rank.
ENDS = {"kill": "os.kill(os.getpid(), signal.SIGKILL)", "fail": "sys.exit(3)"}


def start_pair(order: ExitOrder, first: int, end: str) -> None:
    read, write = os.pipe()
    scripts = {
        first: f"import os, signal, sys, time; time.sleep(0.1); {ENDS[end]}",
        1 - first: f"import os, sys, time; os.read({read}, 1); time.sleep(0.01); sys.exit(1)",
    }
    fds = {first: write, 1 - first: read}
    for rank in range(2):
        cmd = [sys.executable, "-c", scripts[rank]]
        order.watch(subprocess.Popen(cmd, pass_fds=(fds[rank],)))
    os.close(read)
    os.close(write)


@pytest.mark.parametrize(
    ("first", "end", "code", "message"),
    [
        (1, "kill", 137, "meshtrain.launch: rank 1 was killed by SIGKILL (exit code 137)"),
        (0, "fail", 3, "meshtrain.launch: rank 0 exited with code 3"),
    ],
)
def test_supervise_blames_the_rank_that_failed_first(capsys, first, end, code, message):
    other = 1 - first
    for late in (True, False) * 3:  # the old 0.1 s polling lost each late round, most others
        order = ExitOrder()
        start_pair(order, first, end)
        if late:  # both have ended before the launcher looks: zombies, not yet reaped
            for process in order.processes:
                os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        try:
            assert supervise(order, 0, grace_s=5) == code
        finally:
            order.close()
        said = capsys.readouterr().err.splitlines()
        if late:
            assert said == [message]
            assert order.processes[other].returncode == 1  # it failed too, after
        else:  # it may still be running (for its 10 ms) when the launcher stops it
            assert said in ([message], [f"{message}; stopping ranks {other}"])


@pytest.mark.parametrize("use_pidfds", [True, False])  # False: what systems without pidfds do
def test_supervise_passes_over_exit_0_and_stops_the_rest(capsys, use_pidfds):
    scripts = ["import sys; sys.exit(0)", "import sys, time; time.sleep(0.3); sys.exit(4)"]
    order = ExitOrder(use_pidfds=use_pidfds)
    for script in (*scripts, "import time; time.sleep(60)"):
        order.watch(subprocess.Popen([sys.executable, "-c", script]))
    try:
        assert supervise(order, 4, grace_s=5) == 4
    finally:
        order.close()
    assert capsys.readouterr().err == (
        "meshtrain.launch: rank 5 exited with code 4; stopping ranks 6\n"
    )
    assert [p.returncode for p in order.processes] == [0, 4, -signal.SIGTERM]
    order = ExitOrder(use_pidfds=use_pidfds)
    for _ in range(2):
        order.watch(subprocess.Popen([sys.executable, "-c", scripts[0]]))
    assert supervise(order, 0, grace_s=5) == 0
    order.close()


def child_with_rank(parent: int, rank: int) -> int:
    """The process id of the child of `parent` whose environment has RANK=`rank` (Linux /proc)."""
    for pid in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return int(pid)
    raise AssertionError(f"no child of {parent} has RANK={rank}")


def test_ctrl_c_stops_every_process(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    # A shell without job control starts background commands with SIGINT ignored, and an
    # ignored signal stays ignored across exec; a handled one is reset to the default. So SIGINT
    # is handled here while the launcher starts (not reset in a preexec_fn, which would fork
    # this multithreaded JAX process).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launch = subprocess.Popen(
            launcher("--nprocs", "2", str(script), "sleep"),
            cwd=REPO,
            env=subprocess_env(8),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, as in a terminal
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    started = [launch.stdout.readline() for _ in range(2)]
    assert all(" env " in line for line in started), started
    os.killpg(launch.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group
    _, stderr = launch.communicate(timeout=60)
    assert launch.returncode == 130
    assert "meshtrain.launch: SIGINT received; stopping all processes" in stderr


def test_launcher_bad_input_is_one_line_and_exit_code_2():
    env = subprocess_env(8)
    env.update(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500", WORLD_SIZE="8", RANK="6")
    result = run_launcher("--nprocs", "4", str(RUN_TRAINING), env=env, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "meshtrain: error: RANK=6 + --nprocs 4 is more than WORLD_SIZE=8: this machine would run "
        "ranks 6..9, but ranks stop at 7; RANK is the first rank on this machine and WORLD_SIZE "
        "the number of processes on all machines"
    ]


# The multi-process runs below compare with one reference (helpers.one_process: CONSTANT_RUN on
# one device, run in this process). With its constant learning rate a run's program does not
# depend on training.steps: the killed run loads from the compilation cache what the sweep's
# process 0 compiled, and the 8-device runs here share one compile.
RESUMED_STEPS = 5


def popen(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def two_processes(*args: str) -> list[str]:
    return launcher("--nprocs", "2", "--devices-per-process", "4", str(RUN_TRAINING), *args)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, str, str]:
    """MESHES swept by 2 processes × 4 devices in one launch (Hydra multirun), so that the
    processes start once: the launch's directory, its stdout and its stderr."""
    multi = tmp_path_factory.mktemp("multi")
    launch = popen(
        two_processes("-m", f"model.mesh_shape={','.join(MESHES)}", *CONSTANT_RUN),
        multi,
        subprocess_env(1),
    )
    try:
        one_device_losses(RESUMED_STEPS)  # the reference, made here while they run
    except BaseException:
        launch.kill()
        raise
    finally:
        stdout, stderr = launch.communicate(timeout=900)
    assert launch.returncode == 0, stderr[-3000:]
    return multi, stdout, stderr


@pytest.mark.slow  # the sweep: two processes train on two meshes
def test_two_processes_match_one_process_on_every_mesh(sweep):
    """[[8,1]] and a dp mesh, swept in one launch (Hydra multirun) so that the processes start
    once, give the losses of one process (on one device, as every mesh of one process does)."""
    multi, stdout, stderr = sweep
    # One sweep directory for both processes: the launcher's MESHTRAIN_RUN_ID, not each
    # process's own clock.
    (multi_sweep,) = (multi / "multirun" / "tiny").glob("*/*")
    for job, mesh in enumerate(MESHES):
        run_dir = multi_sweep / str(job)
        got, want = losses(run_dir / "metrics.jsonl"), one_device_losses(3)
        assert len(got) == 3, mesh
        # The same global batch and seed: only the order of fp32 sums differs (sharded partial
        # sums, gloo reductions).
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=mesh)
        # Process 0 writes the shared files, the plan among them; process 1 only its own log.
        # Both write the checkpoint, each the shards it holds.
        names = {path.name for path in run_dir.iterdir()}
        assert {n for n in names if not n.startswith("events.out.tfevents")} == {
            ".hydra",
            "train.log",
            "metrics.jsonl",
            "rank1.log",
            "checkpoints",
            "plan.json",
        }
        assert committed_steps(run_dir / "checkpoints") == [3]
        assert read_meta(run_dir / "checkpoints" / "3")["data"] == {"step": 3, "position": 24}
        assert len([n for n in names if n.startswith("events.out.tfevents")]) == 1
        main_log = (run_dir / "train.log").read_text()
        rank_log = (run_dir / "rank1.log").read_text()
        assert "process 1 of 2 joined through the torchrun-style environment" in rank_log
        assert "on 8 cpu device(s), 2 process(es)" in main_log and "step 3/3" in main_log
        # Each process reads only its half of every micro-batch of 8 sequences.
        assert "this process reads rows 0:4 of each micro-batch" in main_log
        assert "this process reads rows 4:8 of each micro-batch" in rank_log

    ranked = ("[rank 0] ", "[rank 1] ")
    assert all(line.startswith(ranked) for line in stdout.splitlines() if line)
    assert all(line.startswith((*ranked, "meshtrain.launch: ")) for line in stderr.splitlines())
    steps = [line for line in stdout.splitlines() if "step 3/3" in line]
    assert len(steps) == len(MESHES) and all(line.startswith("[rank 0] ") for line in steps)


@pytest.mark.slow  # one launch of two processes, two runs here, after the sweep
def test_checkpoints_move_between_two_processes_and_one(sweep, tmp_path):
    """A checkpoint written by 2 processes × 4 devices (the sweep's [[8,1]] job, copied)
    resumes in 1 process × 8 devices (here), and one written by 1 process × 8 devices (here)
    resumes in 2 processes × 4; both continue the losses of an uninterrupted 5-step run (a
    constant learning rate after warmup, so the 3-step runs follow the same schedule)."""
    mesh = MESHES[0]
    run = (*CONSTANT_RUN, f"model.mesh_shape={mesh}")
    (multi_sweep,) = (sweep[0] / "multirun" / "tiny").glob("*/*")
    by_two, by_one = tmp_path / "by_two", tmp_path / "by_one"
    shutil.copytree(multi_sweep / str(MESHES.index(mesh)), by_two)
    written = train_command(*run, "training.steps=3", f"hydra.run.dir={by_one}", devices=8)
    assert written.returncode == 0, written.stderr[-3000:]
    # Each resumed by the other topology, at the same time.
    resume = popen(
        two_processes(*run, f"training.steps={RESUMED_STEPS}", f"hydra.run.dir={by_one}"),
        tmp_path,
        subprocess_env(1),
    )
    try:
        resumed = train_command(
            *run, f"training.steps={RESUMED_STEPS}", f"hydra.run.dir={by_two}", devices=8
        )
    except BaseException:
        resume.kill()
        raise
    finally:
        _, stderr = resume.communicate(timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resume.returncode == 0, stderr[-3000:]

    want = one_device_losses(RESUMED_STEPS)
    for written_by, run_dir in ((2, by_two), (1, by_one)):
        log_text = (run_dir / "train.log").read_text()  # both launches, one after the other
        assert "on 8 cpu device(s), 2 process(es)" in log_text
        assert "on 8 cpu device(s), 1 process(es)" in log_text
        assert f"resuming from {run_dir / 'checkpoints' / '3'} at step 3" in log_text
        got = losses(run_dir / "metrics.jsonl")
        assert len(got) == 5, (written_by, got)  # steps 1-3, then 4-5 after the resume
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"written by {written_by}")
        assert committed_steps(run_dir / "checkpoints") == [3, 5]


@pytest.mark.slow  # two processes start and train: the sweep's [[8,1]] program, from the cache
def test_launcher_blames_a_killed_rank_not_the_rank_that_lost_it(tmp_path):
    """SIGKILL to rank 1 of a real run: rank 0 hears of it and exits 1 moments later, but the
    launcher names rank 1 and returns its 137 (the old 0.1 s polling often blamed rank 0)."""
    launch = popen(
        two_processes(
            *CONSTANT_RUN,
            "training.steps=100000",
            f"model.mesh_shape={MESHES[0]}",
            f"hydra.run.dir={tmp_path}",
        ),
        tmp_path,
        subprocess_env(1),
    )
    assert any("step 2/100000" in line for line in launch.stdout), launch.stderr.read()[-3000:]
    os.kill(child_with_rank(launch.pid, 1), signal.SIGKILL)  # mid-training
    _, stderr = launch.communicate(timeout=120)
    assert launch.returncode == 137, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("meshtrain.launch: rank ")]
    blame = "meshtrain.launch: rank 1 was killed by SIGKILL (exit code 137)"
    assert said in ([blame], [f"{blame}; stopping ranks 0"]), stderr[-3000:]
