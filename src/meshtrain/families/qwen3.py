"""Qwen 3 dense (Qwen3ForCausalLM): Llama's block with QK-norm, an explicit head_dim."""

from __future__ import annotations

from typing import Any

from meshtrain.families.base import Family


def _fields(model: Any, kinds: list[str]) -> dict[str, Any]:
    return {
        "mlp_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": model.num_layers,
    }


FAMILY = Family(
    name="qwen3",
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    hf_defaults={  # transformers' Qwen3Config
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
    },
    features=dict(qk_norm=True, post_norms=False, norm_scale_offset=0.0, scale_embeddings=False),
    export_fields=_fields,
)
