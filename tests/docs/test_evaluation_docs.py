"""docs/evaluation.md works as written: its `python ...` lines (```bash blocks) and its python
block run in document order, in a scratch directory (examples/ linked in) with /tmp/meshtrain-eval
replaced by the test's own directory and the training run shortened to 3 steps. The evaluation
writes its results JSON into the run directory; the error example exits with code 2 and prints
the documented line. Lines starting with anything else (`meshtrain-eval ...` with lm-eval's
hub tasks, for a machine that reaches the hub) are not run."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
from helpers.docs import ERROR_PREFIX, RUN_OVERRIDES, STEPS, fenced_blocks
from helpers.harness import METRICS
from helpers.paths import REPO
from helpers.process import scratch_dir, subprocess_env

DOC = REPO / "docs" / "evaluation.md"
DEMO = "/tmp/meshtrain-eval"


def _steps() -> list[tuple[str, str, str | None]]:
    """(kind, code, documented error line) in document order; kind is "bash" or "python"."""
    blocks = fenced_blocks(DOC.read_text())
    steps = []
    for i, block in enumerate(blocks):
        after = blocks[i + 1] if i + 1 < len(blocks) else None
        first = next((ln.strip() for ln in after.lines if ln.strip()), "") if after else ""
        error = first if after and after.lang == "text" and first.startswith(ERROR_PREFIX) else None
        if block.lang == "bash":
            lines = [ln.strip() for ln in block.lines if ln.strip().startswith("python ")]
            steps += [("bash", line, error if line == lines[-1] else None) for line in lines]
        elif block.lang == "python":
            steps.append(("python", "\n".join(block.lines), None))
    return steps


@pytest.mark.slow  # a training run, three evaluations and lm-eval's own command: ~2 minutes
def test_the_evaluation_doc_runs_as_written(tmp_path):
    pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    steps = _steps()
    assert [kind for kind, _, _ in steps] == ["bash"] * 5 + ["python"]
    demo, cwd = str(tmp_path / "demo"), scratch_dir()
    for kind, code, error in steps:
        code = code.replace(DEMO, demo)
        if kind == "python":
            command = [sys.executable, "-c", code]
        else:
            command = shlex.split(code)
            command[0] = sys.executable
            if command[1] == "run_training.py":
                command[1:2] = [str(REPO / "run_training.py")]
                command += RUN_OVERRIDES
        result = subprocess.run(
            command, cwd=cwd, env=subprocess_env(1), capture_output=True, text=True, timeout=600
        )
        described = (
            f"{code}\nexit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        )
        if error is not None:
            assert result.returncode == 2, described
            assert result.stderr.strip().splitlines()[-1] == error, described
            continue
        assert result.returncode == 0, described
        if kind == "python":
            assert float(result.stdout.strip().splitlines()[-1]) > 0, described
        elif "meshtrain.eval" in code:
            output = tmp_path / "demo" / "run" / "eval" / f"step_{STEPS}.json"
            assert result.stdout.strip().splitlines()[-1] == f"results: {output}", described
            results = json.loads(output.read_text())["results"]
            for task, names in METRICS.items():
                assert {f"{n},none" for n in names} <= set(results[task]), described
        elif "eval.harness.tasks" in code:
            lines = (tmp_path / "demo" / "during" / "metrics.jsonl").read_text().splitlines()
            evaluated = [json.loads(x)["step"] for x in lines if "eval/meshtrain_choice" in x]
            assert evaluated == [2, 3], described  # every 2 steps, and the last
        elif "meshtrain.harness" in code:
            assert "|meshtrain_choice|      1|none  |     0|acc     |" in result.stdout, described
