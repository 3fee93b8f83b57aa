"""The commands in README.md and docs/parallelism.md work exactly as written.

Every line of a ```bash block that contains `python run_training.py` is run (README lines that
also `pip install` are only checked for shape), shortened to 3 steps. A command whose bash block
is followed by a ```text block starting with `meshtrain: error:` is an error example: it must exit
with code 2 and print that text as the last line of stderr.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import FAST_COMPILE, REPO, subprocess_env

DOCS = ("docs/parallelism.md", "README.md")
ENTRY = "python run_training.py"
ERROR_PREFIX = "meshtrain: error:"
DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
STEPS = 3
RUN_OVERRIDES = (
    f"training.steps={STEPS}",
    "training.log_every=1",
    "training.eval_every=0",
)


@dataclass(frozen=True)
class Block:
    lang: str
    lines: tuple[str, ...]
    lineno: int  # of the first line inside the fence


@dataclass(frozen=True)
class Command:
    doc: str
    lineno: int
    line: str
    expected_error: str | None  # the documented last stderr line, for error examples


def fenced_blocks(text: str) -> list[Block]:
    blocks, lang, lines, start = [], None, [], 0
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if lang is None and stripped.startswith("```"):
            lang, lines, start = stripped[3:].strip(), [], number + 1
        elif lang is not None and stripped == "```":
            blocks.append(Block(lang, tuple(lines), start))
            lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, "unclosed code fence"
    return blocks


def doc_commands(doc: str) -> list[Command]:
    blocks = fenced_blocks((REPO / doc).read_text())
    commands = []
    for i, block in enumerate(blocks):
        if block.lang != "bash":
            continue
        after = blocks[i + 1] if i + 1 < len(blocks) else None
        documented = [ln.strip() for ln in after.lines if ln.strip()] if after else []
        is_error = (
            after is not None
            and after.lang == "text"
            and len(documented) == 1
            and documented[0].startswith(ERROR_PREFIX)
        )
        for offset, line in enumerate(block.lines):
            if ENTRY not in line or (doc == "README.md" and "pip install" in line):
                continue
            expected = documented[0] if is_error else None
            commands.append(Command(doc, block.lineno + offset, line.strip(), expected))
    return commands


COMMANDS = [command for doc in DOCS for command in doc_commands(doc)]


def parse(line: str) -> tuple[dict[str, str], list[str]]:
    """`[VAR=value ...] python run_training.py args...` → (env assignments, args)."""
    assert not line.endswith("\\"), "documented commands must fit on one line"
    words = shlex.split(line, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert set(env) <= {"XLA_FLAGS"}, f"only XLA_FLAGS may prefix a documented command: {env}"
    assert words[:2] == ["python", "run_training.py"], f"not a `{ENTRY}` command: {line}"
    return env, words[2:]


def run(env_vars: dict[str, str], args: list[str]) -> subprocess.CompletedProcess[str]:
    match = DEVICE_FLAG.search(env_vars.get("XLA_FLAGS", ""))
    env = subprocess_env(int(match.group(1)) if match else 1)
    if "XLA_FLAGS" in env_vars:  # the documented device count, compiled as every test compiles
        env["XLA_FLAGS"] = f"{FAST_COMPILE} {env_vars['XLA_FLAGS']}"
    return subprocess.run(
        [sys.executable, "run_training.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def check_metrics(path: Path) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in records), records


def describe(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit code {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


def run_training_command(
    command: Command, env_vars: dict[str, str], args: list[str], run_dir: Path
) -> subprocess.CompletedProcess[str] | None:
    """Runs a documented training command (shortened) in `run_dir`; an error example is checked
    here (exit code 2 and the documented line) and gives None, any other run must succeed."""
    result = run(env_vars, [*args, *RUN_OVERRIDES, f"hydra.run.dir={run_dir}"])
    if command.expected_error is not None:
        assert result.returncode == 2, describe(result)
        assert result.stderr.strip().splitlines()[-1] == command.expected_error, describe(result)
        return None
    assert result.returncode == 0, describe(result)
    return result


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.doc}:{c.lineno} {c.line}")
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
    check_metrics(tmp_path / "metrics.jsonl")


def test_parallelism_doc_examples() -> None:
    """docs/parallelism.md: every runnable mesh fits in 8 faked devices; two error examples."""
    commands = doc_commands("docs/parallelism.md")
    assert len([c for c in commands if c.expected_error]) == 2
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
    assert "pip install -e '.[test]'" in test and test.endswith("python -m pytest -q")
    assert "python -m pytest -q" in (REPO / ".ci" / "run").read_text()
