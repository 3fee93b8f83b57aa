"""Mixtral (MixtralForCausalLM: Mixtral 8x7B, 8x22B): Llama's attention and every block's MLP a
mixture of eight experts, two per token, the softmax router's two scores always renormalised;
its checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3
(up) and w2 (down)."""

from __future__ import annotations

from typing import Any

from meshtrain.errors import ConfigError
from meshtrain.families.base import Family
from meshtrain.families.experts import check_exportable, moe_from_hf, moe_to_hf
from meshtrain.families.vocabulary import ATTENTION, mixture_of_experts

ARCHITECTURE = "MixtralForCausalLM"


def _read(text: dict[str, Any], source: str) -> dict[str, Any]:
    window = text.get("sliding_window")
    if window is not None and window < text["max_position_embeddings"]:
        raise ConfigError(
            f"{source}: sliding_window={window} is not supported for Mixtral (only null: every "
            "layer attends to all earlier tokens)"
        )
    return moe_from_hf(text, source, expert_dim_key="intermediate_size", normalize_top_k=True)


def _fields(model: Any, kinds: list[str]) -> dict[str, Any]:
    check_exportable(model, ARCHITECTURE)
    if not model.moe.normalize_top_k:
        raise ConfigError(
            f"model.moe.normalize_top_k=false cannot be exported as model.family={model.family} "
            f"({ARCHITECTURE} always renormalises the picked scores); set "
            "model.moe.normalize_top_k=true"
        )
    if model.mlp_dim != model.moe.expert_dim:
        raise ConfigError(
            f"model.mlp_dim={model.mlp_dim} cannot be exported as model.family={model.family}: "
            f"{ARCHITECTURE}'s intermediate_size is one expert's width, model.moe.expert_dim="
            f"{model.moe.expert_dim}; set model.mlp_dim={model.moe.expert_dim}"
        )
    return {
        **moe_to_hf(model, experts_key="num_local_experts"),
        "sliding_window": None,
        "router_jitter_noise": 0.0,
    }


FAMILY = Family(
    name="mixtral",
    architecture=ARCHITECTURE,
    model_type="mixtral",
    hf_defaults={  # transformers' MixtralConfig
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    features=dict(qk_norm=False, post_norms=False, norm_scale_offset=0.0, scale_embeddings=False),
    projections=ATTENTION
    + mixture_of_experts(
        "block_sparse_moe", "gate", "experts", {"gate": "w1", "up": "w3", "down": "w2"}
    ),
    export_fields=_fields,
    read_fields=_read,
)
