"""The token stream does not depend on the number of processes: a run checkpointed with 2
processes resumes with 1 on exactly the batches an uninterrupted run trains on, and the reverse,
with a mixture and document masking. The runs of 1 process run in this process (on its first 4
devices), those of 2 are real processes started by the launcher."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.commands import train_command
from helpers.paths import REPO
from helpers.process import run_launcher, subprocess_env

ENTRY = str(REPO / "run_training.py")


def write_mixture(root: Path) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "pipe", "mesh", "token", "shard"]
    for name, count in (("code", 40), ("prose", 60)):
        with (root / f"{name}.jsonl").open("w") as f:
            for _ in range(count):
                text = " ".join(rng.choice(words, size=int(rng.integers(3, 60))))
                f.write(json.dumps({"text": f"{name}: {text}"}) + "\n")
    return [
        "data.mixture=["
        f"{{name:code,paths:[{root / 'code.jsonl'}],weight:0.7}},"
        f"{{name:prose,paths:[{root / 'prose.jsonl'}],weight:0.3}}]",
        f"data.cache_dir={root / 'cache'}",
    ]


RUN = (
    "model.mesh_shape=[[4,1],[fsdp,tp]]",
    "model.num_layers=1",
    "data.seq_len=32",
    "training.global_batch_size=8",
    "training.lr_schedule=constant",  # the rate at a step does not depend on training.steps
    "training.warmup_steps=2",
    "training.log_every=1",
    "training.eval_every=0",
    "checkpoint.async_save=false",
)


def train(run_dir: Path, data: list[str], steps: int, processes: int) -> None:
    """1 process × 4 devices in this process (its first 4), or `processes` real processes
    sharing 4 devices through the launcher."""
    overrides = [*RUN, *data, f"training.steps={steps}", f"hydra.run.dir={run_dir}"]
    if processes == 1:
        result = train_command(*overrides, devices=4)
    else:
        result = run_launcher(
            "--nprocs", str(processes), "--devices-per-process", str(4 // processes),
            ENTRY, *overrides, env=subprocess_env(4 // processes), timeout=600,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # one launch of two processes; the runs of one process in this process
def test_a_resume_on_another_process_count_continues_the_exact_batches(tmp_path):
    """One run handed from 1 process to 2 and back: 1 process trains steps 1-3, 2 processes
    resume for steps 4-6, 1 process again for 7-9. Each resume continues on exactly the batches
    of an uninterrupted run."""
    data = write_mixture(tmp_path)
    train(tmp_path / "reference", data, steps=9, processes=1)
    reference = metrics(tmp_path / "reference")
    train(tmp_path / "resumed", data, steps=3, processes=1)
    for first, then, steps, logged in (
        (1, 2, 6, [1, 2, 3, 4, 5, 6]),
        (2, 1, 9, [1, 2, 3, 4, 5, 6, 7, 8, 9]),
    ):
        # Resumes from step `steps` - 3, the checkpoint `first` process(es) wrote.
        train(tmp_path / "resumed", data, steps=steps, processes=then)
        resumed = metrics(tmp_path / "resumed")
        assert [m["step"] for m in resumed] == logged, (first, then)
        np.testing.assert_allclose(
            [m["loss"] for m in resumed], [m["loss"] for m in reference[:steps]], rtol=1e-5
        )
        for m, r in zip(resumed, reference[:steps], strict=True):
            assert m["data_share/code"] == r["data_share/code"]
        # `steps` steps of 8 sequences: the logged shares are those of the sequences drawn so far.
        assert abs(resumed[-1]["data_share/code"] - 0.7) < 0.2
        assert resumed[-1]["data_share/code"] + resumed[-1]["data_share/prose"] == pytest.approx(1)
