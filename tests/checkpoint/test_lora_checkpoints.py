"""A LoRA run's checkpoints: the adapters and their optimizer state only, with the identity of
the base; a SIGKILLed QLoRA run resumes bit for bit, and a base that changed since is refused
in one line. `python run_training.py` on a Hugging Face base: the run SIGKILLed is a real
process, the others run the same command in this process (helpers.commands) on its 8 devices."""

import json
import signal

import numpy as np
import pytest
from helpers import tiny_hf
from helpers.commands import train_command
from helpers.paths import REPO
from helpers.process import assert_one_line_error, run_training, subprocess_env
from safetensors.numpy import load_file, save_file

from meshtrain.checkpoint import named_leaves, read_meta, read_params
from meshtrain.checkpoint.writes import TEST_KILL_ENV

pytestmark = pytest.mark.slow  # QLoRA runs on a Hugging Face base, one of them a child process


def _config(base, run_dir):
    return (
        *tiny_hf.overrides("llama", base),
        "data=synthetic",
        "data.seq_len=32",
        'model.mesh_shape=[[4,2],["fsdp","tp"]]',
        "training.micro_batch_size=2",
        "training.steps=6",
        "training.warmup_steps=1",
        "training.log_every=1",
        "training.eval_every=0",
        "checkpoint.every_steps=3",
        "model.lora.rank=4",
        "model.lora.base_dtype=nf4",
        "model.lora.quant_block=16",
        f"hydra.run.dir={run_dir}",
    )


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {entry["step"]: entry["loss"] for entry in map(json.loads, lines)}


def test_a_sigkilled_qlora_run_resumes_bit_identically(tmp_path):
    base = tiny_hf.write_checkpoint("llama", tmp_path / "base")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    result = train_command(*_config(base, straight), devices=8)
    assert result.returncode == 0, result.stderr[-3000:]
    env = subprocess_env(8)
    env[TEST_KILL_ENV] = "3"
    result = run_training(*_config(base, crashed), env=env, timeout=600)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    result = train_command(*_config(base, crashed), devices=8)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {crashed}/checkpoints/3 at step 3" in result.stdout

    expected, got = _losses(straight), _losses(crashed)
    assert [got[s] for s in range(4, 7)] == [expected[s] for s in range(4, 7)]
    final = read_meta(crashed / "checkpoints" / "6")
    assert final["fingerprints"] == read_meta(straight / "checkpoints" / "6")["fingerprints"]
    # The checkpoint holds the adapters (7 per layer × A and B) and names the base.
    names = named_leaves(read_params(crashed / "checkpoints" / "6")[0])
    assert len(names) == 3 * 7 * 2 and all("_lora_" in name for name in names)
    assert final["lora_base"]["source"] == f"hf:{base}"
    assert len(final["lora_base"]["sha256"]) == 64

    # Resharded: the adapters continue on another mesh (their saved layout has none).
    result = train_command(
        *_config(base, crashed),
        "training.steps=7",
        'model.mesh_shape=[[2,4],["fsdp","tp"]]',
        "training.micro_batch_size=4",  # the same global batch of 8
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {crashed}/checkpoints/6 at step 6" in result.stdout
    assert "model.mesh_shape" in result.stdout  # logged as an allowed change

    # The base changed on disk since: the resume is refused before anything compiles.
    weights = load_file(base / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = weights[name] + np.float32(0.01)
    save_file(weights, base / "model.safetensors")
    result = train_command(*_config(base, crashed), "training.steps=8", devices=8)
    documented = next(
        line
        for line in (REPO / "docs" / "finetuning.md").read_text().splitlines()
        if "model.lora.base hf:" in line
    )
    expected = documented.replace("/run/checkpoints/2", f"{crashed}/checkpoints/7").replace(
        "hf:/models/base", f"hf:{base}"
    )
    assert_one_line_error(result, expected.removeprefix("meshtrain: error: "))
    assert "compiling" not in result.stdout
