"""Gemma 3 (Gemma3ForCausalLM; the text model of Gemma3ForConditionalGeneration): QK-norm,
sandwich norms stored as scale - 1, scaled embeddings, GeGLU, five local (sliding-window) layers
to one global with their own RoPE base, and an attention scale of its own."""

from __future__ import annotations

from typing import Any

from meshtrain.families.base import Family


def _whole(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def _fields(model: Any, kinds: list[str]) -> dict[str, Any]:
    fields = dict(
        # transformers types it int (Gemma 3 uses 256 and 168)
        query_pre_attn_scalar=_whole(model.query_pre_attn_scalar or model.head_dim),
        rope_local_base_freq=model.rope_local_theta or model.rope_theta,
        sliding_window=model.sliding_window or model.max_seq_len,
        layer_types=[
            "sliding_attention" if kind == "local" else "full_attention" for kind in kinds
        ],
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    )
    pattern = model.attention_pattern
    if pattern[-1] == "global" and "global" not in pattern[:-1]:
        # what transformers < 4.53 reads instead of layer_types: every n-th layer is global
        fields["sliding_window_pattern"] = len(pattern)
    return fields


FAMILY = Family(
    name="gemma3",
    architecture="Gemma3ForCausalLM",
    model_type="gemma3_text",
    also_reads=("gemma3",),
    hf_defaults={  # transformers' Gemma3TextConfig
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
    features=dict(qk_norm=True, post_norms=True, norm_scale_offset=1.0, scale_embeddings=True),
    activation_key="hidden_activation",
    sliding_layers=True,
    attention_scale=True,
    export_fields=_fields,
)
