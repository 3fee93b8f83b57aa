"""Two processes (2 faked CPU devices each, one 4-device mesh): process 0 runs the harness, the
other runs its programs as they come (harness.engine), and both return the metrics one process
computes alone. Slow: two children that start JAX's distributed runtime."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.harness import EXAMPLE_TASKS, MAX_LENGTH, TASKS, write_tiny_llama
from helpers.process import scratch_dir, subprocess_env

pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")

import meshtrain
from meshtrain.distributed.launcher import free_port
from meshtrain.harness.run import evaluate_in_place

CHILD = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{sys.argv[1]}", num_processes=2, process_id=int(sys.argv[2]))
import meshtrain
from meshtrain.harness.run import evaluate_in_place
checkpoint, tasks = sys.argv[3], sys.argv[4].split(",")
model = meshtrain.load_hf(checkpoint, [[2, 2], ["fsdp", "tp"]])
metrics = evaluate_in_place(
    model, meshtrain.build_tokenizer(checkpoint), tasks, limit=3,
    include_path=[sys.argv[5]], max_length=int(sys.argv[6]),
)
print("METRICS " + json.dumps(metrics, sort_keys=True))
"""


@pytest.mark.slow  # ~40 s on 2 cores
def test_process_0_drives_and_the_other_follows(tmp_path):
    checkpoint = write_tiny_llama(tmp_path / "llama")
    port = free_port()
    args = [port, None, checkpoint, ",".join(TASKS), EXAMPLE_TASKS, MAX_LENGTH]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, *map(str, [*args[:1], rank, *args[2:]])],
            cwd=scratch_dir(),
            env=subprocess_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    for child in children:
        stdout, stderr = child.communicate(timeout=600)
        assert child.returncode == 0, stderr[-3000:]
        (line,) = [ln for ln in stdout.splitlines() if ln.startswith("METRICS ")]
        outputs.append(json.loads(line.removeprefix("METRICS ")))
    assert outputs[0] == outputs[1]
    alone = evaluate_in_place(
        meshtrain.load_hf(checkpoint),
        meshtrain.build_tokenizer(str(checkpoint)),
        TASKS,
        limit=3,
        include_path=[EXAMPLE_TASKS],
        max_length=MAX_LENGTH,
    )
    assert outputs[0].keys() == alone.keys()
    for task, metrics in alone.items():
        assert outputs[0][task] == pytest.approx(metrics, rel=1e-5)
