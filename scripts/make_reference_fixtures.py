"""Writes tests/fixtures/hf/: what the default tests compare meshtrain against, computed by
transformers, so that those tests need no torch.

    pip install -e '.[test,parity]' && python scripts/make_reference_fixtures.py

For each family of tests/helpers/tiny_hf.py (llama, qwen3, gemma3): the checkpoint's
config.json and tensor layout as save_pretrained writes them (Gemma's split into several files),
and reference.npz with transformers' logits of tiny_hf.TOKENS and its loss and gradient norm on
the batch of a run's step 1 (and, for Llama, its greedy generation of tiny_hf.PROMPT), for the
numpy weights of tiny_hf.weights. Also inputs.json: tiny_hf.fingerprint of those inputs, which a
default test compares with what the tests use now; and parameter_counts.json: the parameters of
transformers' model of each published config in tests/hf_configs/ (built on the meta device).
tests/hf/test_interop_live.py (slow) recomputes all of it and compares.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tests' helpers

from helpers import tiny_hf, tiny_hf_torch  # noqa: E402
from helpers.paths import HF_CONFIGS  # noqa: E402


def layout(family: str, out: Path) -> None:
    """config.json, the index (if split) and tensors.json of save_pretrained's checkpoint."""
    config = AutoConfig.for_model(**tiny_hf.SPECS[family][0])
    model = AutoModelForCausalLM.from_config(config)
    with tempfile.TemporaryDirectory() as saved:
        kwargs = {"max_shard_size": "200KB"} if family == "gemma3" else {}
        model.save_pretrained(saved, **kwargs)
        files = {}
        for file in sorted(Path(saved).glob("*.safetensors")):
            with safe_open(file, framework="numpy") as handle:
                files[file.name] = [
                    [name, list(handle.get_slice(name).get_shape())]
                    for name in handle.keys()  # noqa: SIM118
                ]
        for extra in ("config.json", "model.safetensors.index.json"):
            if (Path(saved) / extra).is_file():
                shutil.copyfile(Path(saved) / extra, out / extra)
    (out / "tensors.json").write_text(json.dumps(files, indent=1) + "\n")


def parameter_counts() -> dict[str, int]:
    counts = {}
    for path in sorted(HF_CONFIGS.glob("*.json")):
        config = AutoConfig.for_model(**json.loads(path.read_text()))
        config = getattr(config, "text_config", config)  # Gemma 3 4B-27B: the language model
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        counts[path.stem] = sum(p.numel() for p in model.parameters())  # tied count once
    return counts


def main() -> None:
    torch.manual_seed(0)
    inputs = {}
    for family in tiny_hf.FAMILIES:
        out = tiny_hf.FIXTURES / family
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        layout(family, out)
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = tiny_hf.write_checkpoint(family, Path(directory))
            numbers = tiny_hf_torch.reference(family, checkpoint)
        np.savez_compressed(out / "reference.npz", **numbers)
        inputs[family] = tiny_hf.fingerprint(family)
        print(f"{family}: {', '.join(numbers)}")
    (tiny_hf.FIXTURES / "inputs.json").write_text(json.dumps(inputs, indent=1) + "\n")
    counts = json.dumps(parameter_counts(), indent=1) + "\n"
    (tiny_hf.FIXTURES / "parameter_counts.json").write_text(counts)


if __name__ == "__main__":
    main()
