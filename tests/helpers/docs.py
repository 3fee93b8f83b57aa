"""The Markdown docs as tests read them: fenced blocks, the `python run_training.py` commands of
their bash blocks, and those commands run (shortened to 3 steps) with the documented outcome.

A command whose bash block is followed by a ```text block starting with `meshtrain: error:` is
an error example: it must exit with code 2 and print that text as the last line of stderr. A
command whose output a checked block shows (helpers.doc_outputs) runs as written, unshortened,
and must print what the block shows.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

from helpers.commands import CommandResult as Result
from helpers.commands import train_command
from helpers.paths import REPO
from helpers.process import FAST_COMPILE, run_training, subprocess_env

if TYPE_CHECKING:
    from helpers.doc_outputs import OutputBlock

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
    output: OutputBlock | None = None  # the checked block that shows its output


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


def python_lines(doc: Path) -> list[str]:
    """The `python ...` lines of a doc's bash blocks, in order: a walk-through's commands as a
    user pastes them (tests/docs/test_preference_docs.py, test_rl_docs.py)."""
    blocks = [b for b in fenced_blocks(doc.read_text()) if b.lang == "bash"]
    return [line.strip() for b in blocks for line in b.lines if line.startswith("python ")]


def walkthrough_checkout(directory: Path) -> Path:
    """`directory` as a checkout a walk-through's commands run in (run_training.py, configs,
    examples and tests linked from the repository), so that their outputs land there."""
    for name in ("run_training.py", "configs", "examples", "tests"):
        (directory / name).symlink_to(REPO / name)
    return directory


def run_walkthrough_line(line: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess[str]:
    """One line of a walk-through run by bash in `cwd` on one faked device; it must succeed (the
    failure shows the line and the ends of its output)."""
    result = subprocess.run(
        ["bash", "-c", line],
        cwd=cwd,
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{line}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def doc_commands(doc: str) -> list[Command]:
    from helpers.doc_outputs import checked_block

    text = (REPO / doc).read_text()
    blocks = fenced_blocks(text)
    lines = text.splitlines()
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
            # an error line marked as an illustration is not this command's
            and not lines[after.lineno - 3].startswith("<!-- output:")
        )
        for offset, line in enumerate(block.lines):
            if ENTRY not in line or (doc == "README.md" and "pip install" in line):
                continue
            expected = documented[0] if is_error else None
            output = checked_block(doc, line)
            commands.append(Command(doc, block.lineno + offset, line.strip(), expected, output))
    return commands


def parse(line: str) -> tuple[dict[str, str], list[str]]:
    """`[VAR=value ...] python run_training.py args...` → (env assignments, args)."""
    assert not line.endswith("\\"), "documented commands must fit on one line"
    words = shlex.split(line, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    allowed = {"XLA_FLAGS", "WANDB_MODE"}
    assert set(env) <= allowed, f"only {sorted(allowed)} may prefix a documented command: {env}"
    assert words[:2] == ["python", "run_training.py"], f"not a `{ENTRY}` command: {line}"
    return env, words[2:]


# Settings that decide how JAX starts (the devices it fakes, the platform it compiles for): a
# command holding one runs in a child process of its own.
STARTS_JAX = ("plan.fake_devices=", "plan.target=")


def run(env_vars: dict[str, str], args: list[str]) -> subprocess.CompletedProcess[str] | Result:
    """A documented command on its XLA_FLAGS' device count (else 1 device): in this process
    (helpers.commands; the first that many of its devices), or, if it sets how JAX starts
    (STARTS_JAX), in a child with the tests' compile flags."""
    match = DEVICE_FLAG.search(env_vars.get("XLA_FLAGS", ""))
    devices = int(match.group(1)) if match else 1
    others = {k: v for k, v in env_vars.items() if k != "XLA_FLAGS"}
    if not any(arg.startswith(STARTS_JAX) for arg in args):
        with mock.patch.dict(os.environ, others):
            return train_command(*args, devices=devices)
    env = subprocess_env(devices)
    if "XLA_FLAGS" in env_vars:  # the documented device count, compiled as every test compiles
        env["XLA_FLAGS"] = f"{FAST_COMPILE} {env_vars['XLA_FLAGS']}"
    env.update(others)
    return run_training(*args, env=env, timeout=600)


def logged_steps(args: list[str] | None = None) -> list[int]:
    """The steps a run logs: every step of a shortened run (RUN_OVERRIDES), else step 1, every
    training.log_every steps and the last (`args`: a command run as written)."""
    if args is None:
        return list(range(1, STEPS + 1))
    values = dict(a.split("=", 1) for a in args if a.startswith("training."))
    steps, every = int(values.get("training.steps", 200)), int(values.get("training.log_every", 10))
    return sorted({1, steps, *range(every, steps + 1, every)})


def check_metrics(path: Path, args: list[str] | None = None) -> None:
    """metrics.jsonl holds finite losses at the logged steps (`args`: of a run as written)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == logged_steps(args)
    assert all(math.isfinite(r["loss"]) for r in records), records


def describe(result: subprocess.CompletedProcess[str] | Result) -> str:
    return f"exit code {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


def run_training_command(
    command: Command, env_vars: dict[str, str], args: list[str], run_dir: Path
) -> subprocess.CompletedProcess[str] | Result | None:
    """Runs a documented training command (shortened) in `run_dir`; an error example is checked
    here (exit code 2 and the documented line) and gives None, any other run must succeed. A
    command whose output a checked block shows runs as written and must print it."""
    from helpers.doc_outputs import check_output

    shortened = [] if command.output is not None else list(RUN_OVERRIDES)
    result = run(env_vars, [*args, *shortened, f"hydra.run.dir={run_dir}"])
    if command.expected_error is not None:
        assert result.returncode == 2, describe(result)
        assert result.stderr.strip().splitlines()[-1] == command.expected_error, describe(result)
        return None
    assert result.returncode == 0, describe(result)
    if command.output is not None:
        problems = check_output(command.output, result.stderr + "\n" + result.stdout)
        assert not problems, (
            f"{command.doc}:{command.output.block.lineno} shows another output than the command "
            "prints; if the change is meant, run `python tests/docs/regenerate_docs.py "
            f"{command.doc}`:\n" + "\n".join(problems)
        )
    return result
