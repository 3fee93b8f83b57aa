"""The commands in docs/multi-node.md (and README.md's launcher line) work as written.

Local launcher lines run (shortened, marked slow: several processes each compile); lines meant
for other machines are checked as far as one machine can: their torchrun-style variables and
launcher plans are valid; the submitit line composes with the plugin, if installed.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from helpers.doc_outputs import check_output, checked_block
from helpers.docs import fenced_blocks, logged_steps
from helpers.paths import REPO
from helpers.process import run_python, run_training

from meshtrain.cli.launch import parse_args
from meshtrain.distributed.environment import read_torchrun_env
from meshtrain.distributed.launcher import node_ranks

DOC = "docs/multi-node.md"
LAUNCH = "python -m meshtrain.launch"
SHORT = ("training.steps=3", "training.log_every=1")  # evaluates at the last step


def bash_lines(doc: str = DOC) -> list[list[str]]:
    """Each ```bash block of `doc` as its lines, comments and blank lines dropped."""
    blocks = fenced_blocks((REPO / doc).read_text())
    return [
        [line.strip() for line in b.lines if line.strip() and not line.strip().startswith("#")]
        for b in blocks
        if b.lang == "bash"
    ]


def split_env(line: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(line.removeprefix("export "))
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


# Launcher lines that run on this machine alone (README.md points to the first one), not the
# two-machine example, whose blocks export the other machines' variables first.
LOCAL_LAUNCHES = sorted(
    {
        line
        for doc in (DOC, "README.md")
        for block in bash_lines(doc)
        if not any(line.startswith("export ") for line in block)
        for line in block
        if line.startswith(LAUNCH)
    }
)


def test_the_doc_has_the_examples_the_issue_asks_for():
    text = (REPO / DOC).read_text()
    for needle in (
        "#SBATCH --nodes=2",
        "srun ",
        "hydra/launcher=submitit_slurm",
        "MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 RANK=1 WORLD_SIZE=2 python run_training.py",
        "python -m meshtrain.launch --nprocs 2 --devices-per-process 4 run_training.py",
        "### Firewalls and ports",
        "### Mismatched devices",
        "### A hang on one rank",
        "distributed.timeout_s",
    ):
        assert needle in text, needle
    assert len(LOCAL_LAUNCHES) >= 2


def test_two_machine_example_is_consistent():
    """Machine 1 and 2 of the design docs' example: RANK is each machine's first rank."""
    machines = [block for block in bash_lines() if block[0].startswith("export MASTER_ADDR")]
    assert len(machines) == 2
    ranks = []
    for exports, command in machines:
        env, _ = split_env(exports)
        args = parse_args(shlex.split(command)[3:])
        plan = node_ranks(args.nprocs, env)
        ranks.append(list(range(plan.first_rank, plan.first_rank + args.nprocs)))
        assert plan.world_size == 8
    assert ranks == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_torchrun_style_lines_are_valid():
    lines = [
        line
        for block in bash_lines()
        for line in block
        if line.startswith("MASTER_ADDR=") and "python run_training.py" in line
    ]
    assert len(lines) == 2
    envs = [read_torchrun_env(split_env(line)[0]) for line in lines]
    assert [(e.rank, e.world_size, e.coordinator_address) for e in envs] == [
        (0, 2, "10.0.0.1:29500"),
        (1, 2, "10.0.0.1:29500"),
    ]


def test_submitit_line_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    (line,) = [
        line for block in bash_lines() for line in block if "hydra/launcher=submitit_slurm" in line
    ]
    args = [a for a in shlex.split(line)[2:] if a != "-m"]
    result = run_training(*args, "--cfg", "hydra", devices=1, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "hydra_submitit_launcher.submitit_launcher.SlurmLauncher" in result.stdout
    assert "tasks_per_node: 4" in result.stdout and "nodes: 2" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("line", LOCAL_LAUNCHES)
def test_local_launcher_line(line: str, tmp_path: Path):
    """Shortened to 3 steps; the line whose output the doc shows (a checked block) runs as
    written, 200 steps, and must print what the block shows."""
    words = [str(REPO / w) if w == "run_training.py" else w for w in shlex.split(line)]
    script = words.index(str(REPO / "run_training.py"))
    sweep = "-m" in words[script:]  # Hydra's, not python's
    output = checked_block(DOC, line)
    short = () if output is not None else SHORT
    result = run_python(*words[1:], *short, cwd=tmp_path, devices=1, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    if output is not None:
        problems = check_output(output, result.stderr + "\n" + result.stdout)
        assert not problems, "\n".join(problems)  # or run tests/docs/regenerate_docs.py
    steps = logged_steps(words[script + 1 :]) if output is not None else [1, 2, 3]
    runs = tmp_path / ("multirun" if sweep else "outputs") / "tiny"
    (run,) = runs.glob("*/*")  # one run directory for all processes
    for metrics in [run / "metrics.jsonl"] if not sweep else sorted(run.glob("*/metrics.jsonl")):
        records = [json.loads(x) for x in metrics.read_text().splitlines()]
        assert [r["step"] for r in records] == steps
        assert records[-1]["val_loss"] < records[0]["loss"]


def test_the_cpu_torchrun_example_sets_omp_num_threads_against_torchruns_banner():
    exports = [
        split_env(line)[0]
        for block in bash_lines()
        for line in block
        if line.startswith("export XLA_FLAGS=")
    ]
    assert {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "OMP_NUM_THREADS": "1",
    } in exports
    text = " ".join((REPO / DOC).read_text().split())
    assert (
        "`OMP_NUM_THREADS=1` is what torchrun sets anyway; set explicitly, it spares you torchrun's "
        "banner about it"
    ) in text
    # and Gloo's lines are hidden under torchrun too (tests/distributed/test_runtime_torchrun.py)
    assert "hidden under torchrun as `python -m meshtrain.launch` hides them" in text
    assert "`MESHTRAIN_SHOW_GLOO=1` shows them" in text
