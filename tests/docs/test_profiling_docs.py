"""The commands in docs/profiling.md and docs/planning.md work exactly as written.

The same rules as tests/docs/test_docs.py (with the helpers of tests/helpers/docs.py): each `python run_training.py`
line of a bash block runs, shortened to 3 steps; an error example must exit with code 2 and
print the documented line. A dry run must write plan.json and train nothing; a profiled run
must leave a trace; a run with training.profile_communication must write communication.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers.docs import (
    Command,
    check_metrics,
    describe,
    doc_commands,
    parse,
    run_training_command,
)

from meshtrain.observe.trace import find_trace

DOCS = ("docs/profiling.md", "docs/planning.md")


def marks(command: Command) -> list[pytest.MarkDecorator]:
    """A large model with its layers unrolled compiles for 3 to 5 minutes on 2 cores: a
    rehearsal at a published size (`bench`; `python scripts/checks/check_claims.py --all` measures the
    same plans and checks their totals); so is a published model compiled for a GPU target
    (tests/hardware/test_deviceless.py compiles the tiny one so in the slow set). With
    model.scan_layers=true it takes seconds (tests/observe/test_memory_plan.py plans Gemma 3 27B
    so). Every other command that runs compiles in a child process (5 to 19 s each on 2 cores):
    the slow set, which has the gpu-compile and trackers extras; the README's suite keeps the
    one-line error examples."""
    line = command.line
    large = "model=gemma3_27b" in line or "model=llama3_8b" in line
    gpu_compile = "plan.target=" in line and "training.dry_run=true" in line
    if (large and "model.scan_layers=true" not in line) or (gpu_compile and "model=" in line):
        return [pytest.mark.bench]  # a published model compiled for a GPU: 4 minutes on 2 cores
    return [] if command.expected_error else [pytest.mark.slow]


PLAN_KEYS = {
    "params_bytes",
    "opt_state_bytes",
    "grad_bytes",
    "activation_bytes",
    "collective_bytes_per_step",
    "flops_per_step",
}
COMMANDS = [
    pytest.param(c, marks=marks(c), id=f"{c.doc}:{c.lineno}")
    for doc in DOCS
    for c in doc_commands(doc)
]


def test_the_docs_hold_commands():
    lines = [c.values[0].line for c in COMMANDS]
    assert any("training.profile=true" in line for line in lines)
    assert any("training.dry_run=true" in line and "plan.fake_devices=" in line for line in lines)
    assert any(c.values[0].expected_error for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_documented_command(command, tmp_path: Path) -> None:
    env_vars, args = parse(command.line)
    if "logging.trackers=" in command.line:  # W&B and MLflow: the trackers extra
        pytest.importorskip("wandb")
        pytest.importorskip("mlflow")
    result = run_training_command(command, env_vars, args, tmp_path)
    if result is None:
        return
    plan = json.loads((tmp_path / "plan.json").read_text())  # every run writes its plan
    assert set(plan) >= PLAN_KEYS, plan
    if "training.dry_run=true" in args:
        assert not (tmp_path / "metrics.jsonl").exists()
        fake = [a.split("=")[1] for a in args if a.startswith("plan.fake_devices=")]
        if fake:  # the CLI made that many devices, whatever XLA_FLAGS says
            assert f"on {fake[0]} cpu device(s)" in result.stdout, describe(result)
            assert math.prod(plan["mesh"].values()) == int(fake[0])
        device = [a.split("=")[1] for a in args if a.startswith("plan.device=")]
        if device:
            assert plan["device"] == device[0] and plan["fits"] is not None
            assert (
                f"verdict: {'fits' if plan['fits'] else 'does not fit'} on {device[0]}"
                in result.stdout
            )
        target = [a.split("=")[1] for a in args if a.startswith("plan.target=")]
        if target:  # compiled for that GPU: its kernels, its memory
            report = json.loads((tmp_path / "compile.json").read_text())
            assert plan["device"] == target[0] and plan["fits"], plan
            assert report["attention"].startswith("cudnn (auto: NVIDIA"), report
            assert report["step"]["cudnn_attention_calls"] > 0, report
    else:
        check_metrics(tmp_path / "metrics.jsonl", args if command.output else None)
    if "logging.trackers=" in command.line:  # offline: W&B's run and MLflow's database are here
        assert (tmp_path / "mlflow.db").is_file()
        assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb")), describe(result)
    if "training.profile=true" in args:
        assert find_trace(tmp_path / "profile") is not None
    if "training.profile_communication=true" in args:
        report = json.loads((tmp_path / "communication.json").read_text())
        assert report["collectives"], report
