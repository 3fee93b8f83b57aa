"""objective=dpo against trl's DPOTrainer itself (the parity extra: torch, transformers, peft,
trl), on tiny Hugging Face checkpoints (helpers.tiny_hf) with the real chat templates of the
tests/fixtures/chat tokenizers, the same pairs, fp32, the same AdamW: the step-1 loss, the
rewards/* and logps/* metrics and the gradient norm of every loss type, and three steps of
training, with full weights and with LoRA (trl with a peft model: the reference is the base with
the adapters off), and SimPO against trl's CPOTrainer.

trl's configs default to bf16 autocast (DPOConfig.bf16=True); these comparisons set bf16=False,
as meshtrain's fp32 steps are.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import tiny_hf
from helpers.paths import REPO
from helpers.runs import train_tiny

pytestmark = pytest.mark.slow

LEARNING_RATE, BETA, SMOOTHING = 1e-3, 0.1, 0.1
# The chat fixture of each family's tokenizer (vocabulary < tiny_hf.VOCAB).
TOKENIZERS = {"llama": "llama3", "qwen3": "qwen3"}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
LOGPS = ("logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def trl_libraries():
    for name in ("torch", "transformers", "trl", "datasets"):
        pytest.importorskip(name)


def _pairs(conversational: bool) -> list[dict]:
    """Four pairs whose sequences pack one pair to a row at data.seq_len=127."""
    rng = np.random.default_rng(0)
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "and",
        "then",
        "it",
        "ran",
        "far",
        "away",
        "from",
        "home",
    ]
    pairs = []
    for _ in range(4):
        prompt = " ".join(rng.choice(words, 4))
        chosen = " ".join(rng.choice(words, int(rng.integers(2, 6))))
        rejected = " ".join(rng.choice(words, int(rng.integers(2, 9))))
        if conversational:
            pairs.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
        else:
            pairs.append(
                {"prompt": f"Q: {prompt}\nA:", "chosen": f" {chosen}", "rejected": f" {rejected}"}
            )
    return pairs


def _checkpoint(family: str, tmp_path):
    directory = tiny_hf.write_checkpoint(family, tmp_path / "model")
    for path in (REPO / "tests" / "fixtures" / "chat" / TOKENIZERS[family]).iterdir():
        shutil.copy(path, directory / path.name)
    return directory


def _trl_args(tmp_path, steps: int, **options):
    from trl import DPOConfig

    return DPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=4,
        learning_rate=LEARNING_RATE,
        beta=BETA,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        max_grad_norm=1e9,
        use_cpu=True,
        bf16=False,
        seed=0,
        save_strategy="no",
        max_length=None,
        **options,
    )


def _trl_logs(trainer) -> list[dict]:
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def _meshtrain(tmp_path, family, checkpoint, pairs_file, loss_type, steps, *extra):
    return train_tiny(
        tmp_path,
        *tiny_hf.overrides(family, checkpoint),
        "data=preference",
        "objective=dpo",
        f"objective.loss_type={loss_type}",
        f"objective.beta={BETA}",
        f"objective.label_smoothing={SMOOTHING if loss_type == 'robust' else 0.0}",
        f"data.paths=[{pairs_file}]",
        f"data.tokenizer={checkpoint}",
        "data.seq_len=127",
        "data.validation_fraction=0",
        "training.global_batch_size=4",
        f"training.steps={steps}",
        "training.log_every=1",
        "training.eval_every=0",
        f"training.learning_rate={LEARNING_RATE}",
        "training.warmup_steps=0",
        "training.lr_schedule=constant",
        "training.weight_decay=0",
        "training.grad_clip=0",
        "checkpoint.every_steps=0",
        *extra,
        devices=1,
    ).history


def _compare(ours: list[dict], theirs: list[dict], rtol: float) -> None:
    assert len(ours) == len(theirs)
    for mine, trl in zip(ours, theirs, strict=True):
        for key in ("loss", "grad_norm", *METRICS, *LOGPS):
            np.testing.assert_allclose(mine[key], trl[key], rtol=rtol, atol=1e-6, err_msg=key)


@pytest.mark.parametrize(
    ("family", "loss_type"),
    [("qwen3", "sigmoid"), ("qwen3", "ipo"), ("llama", "hinge"), ("llama", "robust")],
)
def test_three_steps_equal_trls_dpo_trainer(family, loss_type, tmp_path, trl_libraries):
    """Step 1 (the policy is its reference: loss ln 2 for sigmoid) and two AdamW updates on."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOTrainer

    checkpoint = _checkpoint(family, tmp_path)
    pairs = _pairs(conversational=family == "qwen3")
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="eager", dtype=torch.float32
    )
    smoothing = {"label_smoothing": SMOOTHING} if loss_type == "robust" else {}
    trainer = DPOTrainer(
        model=model,
        args=_trl_args(tmp_path, 3, loss_type=[loss_type], **smoothing),
        train_dataset=Dataset.from_list(pairs),
        processing_class=AutoTokenizer.from_pretrained(checkpoint),
    )
    theirs = _trl_logs(trainer)
    ours = _meshtrain(tmp_path / "ours", family, checkpoint, path, loss_type, 3)
    # Step 1 reads the same weights: fp32 sums in another order (measured ~1e-7); two AdamW
    # updates on, a few ulp of each update (measured ~3e-6).
    _compare(ours[:1], theirs[:1], rtol=1e-5)
    _compare(ours, theirs, rtol=1e-4)
    if loss_type == "sigmoid":
        assert ours[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)


def test_lora_equals_trl_with_a_peft_model(tmp_path, trl_libraries):
    """LoRA on all seven projections, starting from the same adapters (made by peft, read by
    model.lora.init_from=peft:); trl's reference is the peft model with its adapters off,
    meshtrain's the base with the adapters zero."""
    import peft
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOTrainer

    checkpoint = _checkpoint("qwen3", tmp_path)
    pairs = _pairs(conversational=True)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="eager", dtype=torch.float32
    )
    trainer = DPOTrainer(  # a new adapter: trl's reference is the model with it disabled
        model=base,
        args=_trl_args(tmp_path, 3, loss_type=["sigmoid"]),
        train_dataset=Dataset.from_list(pairs),
        processing_class=AutoTokenizer.from_pretrained(checkpoint),
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets),
    )
    # B starts at zero in both libraries; give it small random values, so that the adapters
    # change the first step's logits and the reference (adapters off) differs from the policy.
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    trainer.model.save_pretrained(tmp_path / "adapter")
    theirs = _trl_logs(trainer)
    ours = _meshtrain(
        tmp_path / "ours",
        "qwen3",
        checkpoint,
        path,
        "sigmoid",
        3,
        "model.lora.rank=4",
        "model.lora.alpha=8",
        f"model.lora.init_from=peft:{tmp_path / 'adapter'}",
    )
    assert ours[0]["loss"] != pytest.approx(np.log(2), abs=1e-4)  # the adapters are on
    _compare(ours[:1], theirs[:1], rtol=1e-5)
    _compare(ours, theirs, rtol=1e-4)
