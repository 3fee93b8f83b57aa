"""Llama (LlamaForCausalLM): grouped-query attention without QK-norm, SwiGLU, RoPE with
optional llama3 scaling; Llama 2, 3, 3.1 and 3.2."""

from __future__ import annotations

from typing import Any

from meshtrain.families.base import Family


def _fields(model: Any, kinds: list[str]) -> dict[str, Any]:
    return {"mlp_bias": False}


FAMILY = Family(
    name="llama",
    architecture="LlamaForCausalLM",
    model_type="llama",
    hf_defaults={  # transformers' LlamaConfig
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
    },
    features=dict(qk_norm=False, post_norms=False, norm_scale_offset=0.0, scale_embeddings=False),
    export_fields=_fields,
)
