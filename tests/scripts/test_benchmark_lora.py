"""scripts/benchmark_lora.py on a model whose weights dominate its memory (67 M parameters): a
QLoRA step's planned and measured peak memory fall by at least what the frozen nf4 base and the
adapters' state save against full fine-tuning's weights, gradients and two moments."""

import json
import subprocess
import sys

import pytest
from helpers.paths import REPO

MID_SIZE = (
    "model.d_model=1024",
    "model.num_layers=4",
    "model.num_heads=16",
    "model.num_kv_heads=16",
    "model.head_dim=64",
    "model.mlp_dim=4096",
)


@pytest.mark.bench  # a measurement: two child processes, about 60 s
def test_qlora_lowers_the_planned_and_the_measured_peak(tmp_path):
    out = tmp_path / "lora.json"
    command = [sys.executable, str(REPO / "scripts" / "benchmark_lora.py"), "--models", "tiny"]
    command += ["--modes", "full", "qlora", "--seq-len", "64", "--steps", "1", "--json", str(out)]
    command += [f"--override={override}" for override in MID_SIZE]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, qlora = json.loads(out.read_text())["results"]
    params = 4 * (4 * 1024 * 1024 + 3 * 1024 * 4096) + 384 * 1024 + 9 * 1024
    assert full["trainable_params"] == full["total_params"] == params
    assert qlora["trainable_params"] == 4 * 16 * (4 * 2048 + 3 * 5120)  # rank 16, 4 layers
    # What the state saves: 16 bytes per parameter against the nf4 projections (0.5 byte and an
    # fp32 absmax per 64), the fp32 embedding and norms, and the adapters' 16 bytes each.
    projections = params - 384 * 1024 - 9 * 1024
    qlora_state = projections * (0.5 + 4 / 64) + 4 * (params - projections)
    qlora_state += 16 * qlora["trainable_params"]
    saved = 16 * params - qlora_state
    assert saved > 0.9 * 2**30
    planned = (full["planned_step_memory_gib"] - qlora["planned_step_memory_gib"]) * 2**30
    measured = (full["peak_rss_gib"] - qlora["peak_rss_gib"]) * 2**30
    assert planned >= 0.9 * saved
    assert measured >= 0.8 * saved  # the process's peak: JAX's own memory is in both
