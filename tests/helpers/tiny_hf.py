"""Tiny random-weight Hugging Face models of each family (transformers, PyTorch, CPU), saved with
save_pretrained, and the meshtrain overrides that describe the same architecture.

Each is the family's real model config (configs/model/*.yaml) shrunk to hidden 64 and vocab 512;
the Gemma one has 7 layers (5 local with a 16-token window, 1 global, 1 local), so sequences of
40 tokens cross the window; its global layers use linear RoPE scaling like Gemma 3 4B-27B, and
its attention scale 1/sqrt(24) is not 1/sqrt(head_dim), like Gemma 3 27B's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

VOCAB = 512
SEQ_LEN = 40
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
_SHRINK = (
    f"model.vocab_size={VOCAB}",
    "model.d_model=64",
    "model.mlp_dim=128",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=16",
    "model.max_seq_len=256",
)
# family → (HF config in the published key format, meshtrain overrides)
SPECS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "llama": (
        dict(
            model_type="llama",
            num_hidden_layers=3,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=128,
            ),
            **_SHAPE,
        ),
        (
            "model=llama3_8b",
            *_SHRINK,
            "model.num_layers=3",
            "model.rope_original_max_len=128",
            "model.rope_scaling_factor=32.0",
        ),
    ),
    "qwen3": (
        dict(
            model_type="qwen3",
            num_hidden_layers=3,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            **_SHAPE,
        ),
        ("model=qwen3_0_6b", *_SHRINK, "model.num_layers=3"),
    ),
    "gemma3": (
        dict(
            model_type="gemma3_text",
            num_hidden_layers=7,
            sliding_window=16,
            query_pre_attn_scalar=24,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling=dict(rope_type="linear", factor=8.0),
            **_SHAPE,
        ),
        (
            "model=gemma3_4b",
            *_SHRINK,
            "model.num_layers=7",
            "model.sliding_window=16",
            "model.query_pre_attn_scalar=24",
        ),
    ),
}
FAMILIES = tuple(SPECS)


def build(family: str, seed: int = 0) -> PreTrainedModel:
    """A random-weight model; norms are randomised too (around 1, or around 0 for Gemma's
    1 + w), so that a misplaced or swapped tensor changes the logits."""
    config = AutoConfig.for_model(**SPECS[family][0])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.ndim == 1:
                parameter.copy_((0.0 if family == "gemma3" else 1.0) + 0.2 * noise)
            else:
                parameter.copy_(0.08 * noise)
    return model


def save(family: str, directory: Path, **save_kwargs) -> PreTrainedModel:
    model = build(family)
    model.save_pretrained(directory, **save_kwargs)
    return model


def logits(model: PreTrainedModel, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def overrides(family: str, directory: Path) -> tuple[str, ...]:
    return (*SPECS[family][1], f"model.init_from=hf:{directory}")
