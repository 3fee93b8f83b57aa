"""docs/models.md works as written: its bash and python blocks run in order (the walkthrough
builds on itself), in a scratch directory instead of /tmp/meshtrain-demo, with training runs
shortened to 3 steps, on the devices an `XLA_FLAGS=...` prefix fakes (else one). An error example must exit with code 2 and print the documented line."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from helpers.docs import DEVICE_FLAG, ENTRY, ERROR_PREFIX, RUN_OVERRIDES, fenced_blocks
from helpers.paths import REPO
from helpers.process import subprocess_env

DOC = REPO / "docs" / "models.md"
DEMO = "/tmp/meshtrain-demo"
TRAINING_COMMANDS = (ENTRY, "python examples/finetune_hf.py")


def _steps() -> list[tuple[str, str, str | None]]:
    """(kind, code, expected error line) in document order; kind is "bash" or "python"."""
    blocks = fenced_blocks(DOC.read_text())
    steps = []
    for i, block in enumerate(blocks):
        after = blocks[i + 1] if i + 1 < len(blocks) else None
        documented = [ln.strip() for ln in after.lines if ln.strip()] if after else []
        error = (
            documented[0]
            if after and after.lang == "text" and documented[0].startswith(ERROR_PREFIX)
            else None
        )
        if block.lang == "bash":
            steps += [("bash", line.strip(), error) for line in block.lines if line.strip()]
        elif block.lang == "python":
            steps.append(("python", "\n".join(block.lines), None))
    return steps


@pytest.mark.slow  # 19 s on 2 cores
def test_the_walkthrough_runs_as_documented(tmp_path):
    steps = _steps()
    assert sum(kind == "bash" for kind, _, _ in steps) >= 7
    demo = str(tmp_path / "demo")
    for index, (kind, code, error) in enumerate(steps):
        code, devices = code.replace(DEMO, demo), 1
        if faked := re.match(r"XLA_FLAGS=(\S+) ", code):  # the devices the command fakes
            devices, code = int(DEVICE_FLAG.search(faked.group(1)).group(1)), code[faked.end() :]
        if kind == "python":
            command = [sys.executable, "-c", code]
        else:
            command = shlex.split(code)
            if command[0] == "python":
                command[0] = sys.executable
            if any(code.startswith(c) for c in TRAINING_COMMANDS) and error is None:
                command += [*RUN_OVERRIDES]
            if code.startswith(ENTRY) and "hydra.run.dir=" not in code:
                command.append(f"hydra.run.dir={tmp_path / f'run{index}'}")  # each its own
            elif code.startswith(TRAINING_COMMANDS[1]):
                command += ["--run-dir", str(tmp_path / "finetune-run")]
        result = subprocess.run(
            command,
            cwd=REPO,
            env=subprocess_env(devices),
            capture_output=True,
            text=True,
            timeout=600,
        )
        described = (
            f"{code}\nexit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        )
        if error is not None:
            assert result.returncode == 2, described
            assert result.stderr.strip().splitlines()[-1] == error.replace(DEMO, demo), described
            continue
        assert result.returncode == 0, described
        if kind == "bash" and "meshtrain.generate" in code:
            assert result.stdout.startswith("def main("), described
        if kind == "python" and "model(tokens)" in code:
            assert re.match(r"\(1, \d+, 384\) ", result.stdout), described
    # Every checkpoint the walkthrough writes loads in transformers' format: config and weights.
    for name in ("hf", "finetuned", "bf16"):
        assert sorted(p.name for p in (tmp_path / "demo" / name).iterdir()) == [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
