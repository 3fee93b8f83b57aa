"""Qwen 3 mixture of experts (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen 3's
attention (QK-norm) and every block's MLP a mixture of experts, the softmax router's top-k scores
renormalised where norm_topk_prob says, no shared expert."""

from __future__ import annotations

from typing import Any

from meshtrain.families.base import Family
from meshtrain.families.experts import check_exportable, moe_from_hf, moe_to_hf
from meshtrain.families.vocabulary import ATTENTION, mixture_of_experts

ARCHITECTURE = "Qwen3MoeForCausalLM"


def _read(text: dict[str, Any], source: str) -> dict[str, Any]:
    return moe_from_hf(
        text, source, expert_dim_key="moe_intermediate_size", normalize_top_k="norm_topk_prob"
    )


def _fields(model: Any, kinds: list[str]) -> dict[str, Any]:
    check_exportable(model, ARCHITECTURE)
    return {
        **moe_to_hf(model, experts_key="num_experts"),
        "moe_intermediate_size": model.moe.expert_dim,
        "norm_topk_prob": model.moe.normalize_top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "mlp_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": model.num_layers,
    }


FAMILY = Family(
    name="qwen3_moe",
    architecture=ARCHITECTURE,
    model_type="qwen3_moe",
    hf_defaults={  # transformers' Qwen3MoeConfig
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
    features=dict(qk_norm=True, post_norms=False, norm_scale_offset=0.0, scale_embeddings=False),
    projections=ATTENTION
    + mixture_of_experts(
        "mlp", "gate", "experts", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    ),
    export_fields=_fields,
    read_fields=_read,
)
