"""LoRA out of meshtrain, checked by the field's own libraries (the parity extra): the merged
export loaded by transformers, and the PEFT export loaded by peft on the Hugging Face base, give
the logits meshtrain computes with the adapters unmerged; a QLoRA run's merged export carries the
dequantised base the run trained on."""

import jax
import numpy as np
import pytest
from helpers import tiny_hf
from helpers.runs import train_tiny
from helpers.tiny_hf import TOKENS, relative_error

import meshtrain
from meshtrain.inference.export import export

pytestmark = pytest.mark.slow

FAMILIES = ("llama", "gemma3")


@pytest.fixture(scope="module")
def torch_libraries():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from helpers import tiny_hf_torch

    return tiny_hf_torch


def _lora_run(family, tmp_path, *extra):
    base = tiny_hf.write_checkpoint(family, tmp_path / "base")
    result = train_tiny(
        tmp_path / "run",
        *tiny_hf.overrides(family, base),
        "data=synthetic",
        f"data.seq_len={tiny_hf.SEQ_LEN}",
        "model.mesh_shape=[[4,2],[fsdp,tp]]",
        "training.steps=3",
        "training.learning_rate=0.02",
        "training.warmup_steps=1",
        "training.eval_every=0",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        *extra,
        devices=8,
    )
    return base, result


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_and_peft_exports_give_meshtrains_lora_logits(family, tmp_path, torch_libraries):
    import peft

    base, _ = _lora_run(family, tmp_path)
    ours = np.asarray(meshtrain.load_checkpoint(tmp_path / "run")(TOKENS))
    plain = np.asarray(meshtrain.load_hf(base)(TOKENS))
    assert relative_error(ours, plain) > 1e-3  # the adapters trained: they change the logits

    export(tmp_path / "run", tmp_path / "merged", "hf", merge=True)
    merged = torch_libraries.logits(torch_libraries.load(tmp_path / "merged"), TOKENS)
    assert relative_error(ours, merged) <= 1e-5

    export(tmp_path / "run", tmp_path / "adapter", "peft")
    with_adapter = peft.PeftModel.from_pretrained(
        torch_libraries.load(base), tmp_path / "adapter"
    ).eval()
    assert relative_error(ours, torch_libraries.logits(with_adapter, TOKENS)) <= 1e-5


def test_a_qlora_merge_holds_the_dequantised_base(tmp_path, torch_libraries):
    base, result = _lora_run(
        "llama", tmp_path, "model.lora.base_dtype=int8", "model.lora.quant_block=16"
    )
    ours = np.asarray(meshtrain.load_checkpoint(tmp_path / "run")(TOKENS))
    export(tmp_path / "run", tmp_path / "merged", "hf", merge=True)
    merged = torch_libraries.logits(torch_libraries.load(tmp_path / "merged"), TOKENS)
    assert relative_error(ours, merged) <= 1e-5
    assert jax.tree.leaves(result.state.frozen)  # (the run held a quantised base)
    # The adapters alone, on the full-precision base peft loads them on, are another model:
    # the export says so (its README and the log) and names the merged export.
    import peft

    export(tmp_path / "run", tmp_path / "adapter", "peft")
    note = (tmp_path / "adapter" / "README.md").read_text()
    assert "trained on the base quantised to int8 (blocks of 16)" in note and "--merge" in note
    with_adapter = peft.PeftModel.from_pretrained(
        torch_libraries.load(base), tmp_path / "adapter"
    ).eval()
    assert relative_error(ours, torch_libraries.logits(with_adapter, TOKENS)) > 1e-5
