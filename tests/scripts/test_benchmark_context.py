"""scripts/benchmark_context.py: a measured cell and a planned one, at a short length."""

import json
import subprocess
import sys

import pytest
from helpers.paths import REPO
from helpers.process import subprocess_env


@pytest.mark.bench  # a measurement: two children of 8 faked devices, 20 s
def test_a_measured_and_a_planned_cell(tmp_path):
    out = tmp_path / "context.json"
    command = [sys.executable, "scripts/benchmark_context.py", "--lengths", "512"]
    command += ["--plan-only", "1024", "--cp", "4", "--json", str(out)]
    subprocess.run(command, cwd=REPO, env=subprocess_env(8), check=True, timeout=600)
    measured, planned = json.loads(out.read_text())["results"]
    assert (measured["seq_len"], measured["cp"], measured["tp"]) == (512, 4, 2)
    assert measured["run"] == "measured" and measured["step_time_s"] > 0
    assert 0 < measured["planned_gib_per_device"] < measured["peak_rss_gib"]
    assert planned["run"] == "planned only" and "step_time_s" not in planned
    # Twice the sequence on the same split: more memory planned per device.
    assert planned["planned_gib_per_device"] > measured["planned_gib_per_device"]
