"""scripts/benchmark_generate.py: one quick run of the tiny model reports consistent numbers as
JSON (the tokens/s docs/models.md records come from it), also beside transformers' generate."""

import json
import subprocess
import sys

import pytest
from helpers.paths import REPO


@pytest.mark.bench  # a measurement: a child process timing generation
def test_tiny_quick_json():
    command = [sys.executable, str(REPO / "scripts" / "benchmark_generate.py")]
    args = ["--prompt-tokens", "5", "--new-tokens", "6", "--batch", "2", "--runs", "3", "--json"]
    proc = subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.strip().splitlines()
    result = json.loads(line)
    assert (result["model"], result["prompt_tokens"], result["new_tokens"]) == ("tiny", 5, 6)
    assert len(result["runs_s"]) == 3 and result["median_s"] == sorted(result["runs_s"])[1]
    assert result["tokens_per_sec"] == pytest.approx(2 * 6 / result["median_s"])
    alone = sorted(result["one_at_a_time_runs_s"])[1]
    assert result["batched_speedup"] == pytest.approx(alone / result["median_s"])
    assert result["first_call_s"] > result["median_s"] > 0  # the first call compiles
    assert result["command"].startswith("python scripts/benchmark_generate.py --prompt-tokens 5")
    for key in ("machine", "date", "jax"):
        assert result[key]


@pytest.mark.slow  # imports torch (the parity extra)
@pytest.mark.bench  # a measurement: a child process timing generation, and transformers'
def test_against_transformers_generate():
    pytest.importorskip("torch", reason="the parity extra (torch, transformers) is not installed")
    command = [sys.executable, str(REPO / "scripts" / "benchmark_generate.py")]
    args = ["--prompt-tokens", "5", "--new-tokens", "6", "--batch", "2", "--runs", "3"]
    proc = subprocess.run(
        [*command, *args, "--transformers", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    theirs = sorted(result["transformers_runs_s"])[1]
    assert len(result["transformers_runs_s"]) == 3 and theirs > 0
    assert result["transformers_tokens_per_sec"] == pytest.approx(2 * 6 / theirs)
    assert result["speedup_over_transformers"] == pytest.approx(theirs / result["median_s"])
