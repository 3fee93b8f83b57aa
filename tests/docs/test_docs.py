"""The commands in README.md and docs/parallelism.md work exactly as written.

Every line of a ```bash block that contains `python run_training.py` is run (README lines that
also `pip install` are only checked for shape), shortened to 3 steps. A command whose bash block
is followed by a ```text block starting with `meshtrain: error:` is an error example: it must exit
with code 2 and print that text as the last line of stderr.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers.docs import (
    DEVICE_FLAG,
    ENTRY,
    RUN_OVERRIDES,
    Command,
    check_metrics,
    describe,
    doc_commands,
    fenced_blocks,
    parse,
    run,
    run_training_command,
)
from helpers.paths import REPO

DOCS = ("docs/parallelism.md", "README.md")


def is_slow(command: Command) -> bool:
    """A command that trains or plans compiles its own programs in a child process (4 to 17 s
    each on 2 cores): those run in the slow set, and the README's suite keeps the commands that
    print (--help, --cfg job) or stop with a one-line error. The training tests check the
    examples' meshes and schedules in process (tests/train/test_loop.py, test_pipeline.py,
    test_context_parallel.py)."""
    prints = any(flag in command.line.split() for flag in ("--help", "--cfg"))
    return not (prints or command.expected_error)


COMMANDS = [
    pytest.param(
        command,
        marks=[pytest.mark.slow] if is_slow(command) else [],
        id=f"{command.doc}:{command.lineno} {command.line}",
    )
    for doc in DOCS
    for command in doc_commands(doc)
]


@pytest.mark.parametrize("command", COMMANDS)
def test_documented_command(command: Command, tmp_path: Path) -> None:
    env_vars, args = parse(command.line)
    if "--help" in args or "--cfg" in args:
        result = run(env_vars, args)
        assert result.returncode == 0, describe(result)
        assert "training:" in result.stdout, describe(result)
        return
    if "-m" in args or "--multirun" in args:
        result = run(env_vars, [*args, *RUN_OVERRIDES, f"hydra.sweep.dir={tmp_path}"])
        assert result.returncode == 0, describe(result)
        jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and p.name.isdigit())
        assert len(jobs) >= 2, describe(result)
        for job in jobs:
            check_metrics(job / "metrics.jsonl")
        return
    result = run_training_command(command, env_vars, args, tmp_path)
    if result is None:
        return
    if "training.dry_run=true" in args:  # plans, trains nothing (docs/planning.md)
        assert (tmp_path / "plan.json").is_file(), describe(result)
        assert not (tmp_path / "metrics.jsonl").exists(), describe(result)
        return
    check_metrics(tmp_path / "metrics.jsonl", args if command.output else None)


def test_parallelism_doc_examples() -> None:
    """docs/parallelism.md: every runnable mesh fits in 8 faked devices; three error examples."""
    commands = doc_commands("docs/parallelism.md")
    assert len([c for c in commands if c.expected_error]) == 3
    for command in commands:
        env_vars, _ = parse(command.line)
        match = DEVICE_FLAG.search(env_vars.get("XLA_FLAGS", ""))
        assert match and 1 <= int(match.group(1)) <= 8, command.line
    lines = {c.line for c in commands}
    assert any('\'model.mesh_shape=[[4,1],["fsdp","tp"]]\'' in line for line in lines)
    assert any("model.mesh_shape=[[4,1],[fsdp,tp]]" in line for line in lines)
    assert any("[[-1," in line for line in lines)
    assert any("training.global_batch_size=" in line for line in lines)


def test_readme_quick_start() -> None:
    """The README's first section holds exactly two one-line commands: train, and test."""
    text = (REPO / "README.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    assert len(sections) > 2
    first = sections[1]
    assert first.splitlines()[0].strip() == "Quick start"
    blocks = [b for b in fenced_blocks(first) if b.lang == "bash"]
    commands = [line.strip() for b in blocks for line in b.lines if line.strip()]
    assert len(blocks) == 2 and len(commands) == 2, commands
    train, test = commands
    assert "pip install -e ." in train and train.endswith(ENTRY)
    assert "pip install -e '.[test]'" in test and test.endswith("python -m pytest -q -n 2")


def test_ci_runs_the_readme_commands_as_written() -> None:
    """.ci/run reads the Quick start's two commands from README.md and runs each as written, in
    a fresh .venv, before it installs any other extra."""
    ci = (REPO / ".ci" / "run").read_text()
    function = re.search(r"^quick_start\(\) \{$.*?^\}$", ci, flags=re.MULTILINE | re.DOTALL)
    assert function is not None
    printed = subprocess.run(
        ["bash", "-c", f"{function.group(0)}\nquick_start"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    first = re.split(r"^## ", (REPO / "README.md").read_text(), flags=re.MULTILINE)[1]
    documented = [ln.strip() for b in fenced_blocks(first) if b.lang == "bash" for ln in b.lines]
    assert printed == [line for line in documented if line]
    lines = ci.splitlines()
    fresh = lines.index("rm -rf .venv  # the README's commands start from a fresh venv")
    runs = [i for i, line in enumerate(lines) if 'bash -euo pipefail -c "${readme[' in line]
    extras = next(i for i, line in enumerate(lines) if "pip install" in line and "parity" in line)
    assert fresh < runs[0] < runs[1] < extras and len(runs) == 2
