"""docs/checkpointing.md: its commands, run in order as written, do what the text says.

Every line of a ```bash block that starts with `python` or `XLA_FLAGS=` runs as written (with
the tests' compile flags added to XLA_FLAGS), in document order, in a scratch directory where run_training.py and configs/ link to this
repository's, so that the relative paths (outputs/demo, ...) chain from one command to the next.
Lines starting with anything else (`timeout ...`, for trying by hand) and ```text blocks are not run.
"""

import json
import subprocess

import pytest
from helpers.docs import fenced_blocks
from helpers.paths import REPO
from helpers.process import FAST_COMPILE, subprocess_env
from safetensors.numpy import load_file

from meshtrain.checkpoint import committed_steps, read_meta

DOC = REPO / "docs" / "checkpointing.md"


def runnable_lines() -> list[str]:
    blocks = [b for b in fenced_blocks(DOC.read_text()) if b.lang == "bash"]
    return [
        line.strip()
        for block in blocks
        for line in block.lines
        if line.strip().startswith(("python ", "XLA_FLAGS="))
    ]


def with_fast_compile(line: str) -> str:
    """The line with the tests' compile flags added to its own XLA_FLAGS=... prefix, if any."""
    if not line.startswith("XLA_FLAGS="):
        return line
    flags, rest = line.removeprefix("XLA_FLAGS=").split(" ", 1)
    return f"XLA_FLAGS='{FAST_COMPILE} {flags}' {rest}"


def first_loss(run_dir) -> float:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["loss"]


@pytest.mark.slow  # 27 s; tests/checkpoint covers each step
def test_checkpointing_doc_commands_run_in_order(tmp_path):
    (tmp_path / "run_training.py").symlink_to(REPO / "run_training.py")
    (tmp_path / "configs").symlink_to(REPO / "configs")
    lines = runnable_lines()
    assert len(lines) == 7, lines
    outputs = []
    for line in lines:
        result = subprocess.run(
            ["bash", "-c", with_fast_compile(line)],
            cwd=tmp_path,
            env=subprocess_env(1),  # a line's own XLA_FLAGS=... prefix wins
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"{line}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        outputs.append(result.stdout + result.stderr)

    demo = tmp_path / "outputs" / "demo"
    # 40 steps on one device, then on to 60 on an 8-device fsdp mesh.
    assert f"resuming from {demo}/checkpoints/40 at step 40" in outputs[1]
    assert "mesh [[1,1,8,1,1,1],[dp,pp,fsdp,ep,cp,tp]] on 8 cpu device(s)" in outputs[1]
    assert committed_steps(demo / "checkpoints") == [20, 40, 60]
    steps = [json.loads(x)["step"] for x in (demo / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 10, 20, 30, 40, 41, 50, 60]

    # Fine-tuning starts from the exported step-60 weights: its first loss is far below the
    # ≈5.95 of a fresh model (uniform over 384 tokens).
    assert read_meta(tmp_path / "outputs" / "demo_export")["step"] == 60
    assert f"parameters from {tmp_path}/outputs/demo_export (step 60)" in outputs[3]
    assert first_loss(tmp_path / "outputs" / "finetune") < 4.0
    assert committed_steps(tmp_path / "outputs" / "finetune" / "checkpoints") == [20]

    tensors = load_file(tmp_path / "outputs" / "demo_safetensors" / "model.safetensors")
    assert tensors["embed"].shape == (384, 128) and "blocks.1.mlp.down" in tensors
    hf = json.loads((tmp_path / "outputs" / "demo_hf" / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["hidden_size"] == 128
    # The HF export of this byte-tokenized run carries its tokenizer: generate needs nothing more.
    assert outputs[6].startswith("def ") and len(outputs[6]) > len("def \n")
