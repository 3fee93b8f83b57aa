"""config.json's mixture-of-experts keys ↔ model.moe, for the families whose feed-forward is one
(Qwen3-MoE, Mixtral): the keys they share, each family naming its own where they differ."""

from __future__ import annotations

from typing import Any

from meshtrain.errors import ConfigError
from meshtrain.families.vocabulary import ModelConfig


def moe_from_hf(
    text: dict[str, Any], source: str, *, expert_dim_key: str, normalize_top_k: bool | str
) -> dict[str, Any]:
    """{"moe": model.moe's architecture keys} from config.json's `text` (with the family's
    defaults): the experts (num_experts, or num_local_experts as Mixtral and transformers 5
    write it), top-k, one expert's width (`expert_dim_key`), and whether the picked scores are
    renormalised (a bool, or the key that says so). A layout meshtrain's block cannot hold is
    refused in one line."""
    for key, supported in (
        ("decoder_sparse_step", 1),
        ("mlp_only_layers", []),
        ("router_jitter_noise", 0.0),
        ("shared_expert_intermediate_size", 0),
        ("scoring_func", "softmax"),
        ("topk_method", "greedy"),
    ):
        if text.get(key, supported) not in (supported, None):
            raise ConfigError(
                f"{source}: {key}={text[key]!r} is not supported (meshtrain's experts: every "
                f"layer a mixture of experts, no shared expert, no router noise, a softmax "
                f"router's greedy top-k; {key}={supported!r})"
            )
    # transformers 5 writes both families' as num_local_experts; the published Qwen3-MoE files
    # say num_experts (and its config class's default is under that name)
    experts = text.get("num_local_experts", text.get("num_experts"))
    normalize = text[normalize_top_k] if isinstance(normalize_top_k, str) else normalize_top_k
    return {
        "moe": {
            "num_experts": int(experts),
            "top_k": int(text["num_experts_per_tok"]),
            "expert_dim": int(text[expert_dim_key]),
            "normalize_top_k": bool(normalize),
        }
    }


def moe_to_hf(model: ModelConfig, *, experts_key: str) -> dict[str, Any]:
    """config.json's mixture-of-experts keys shared by the families: the experts (under
    `experts_key`), top-k and the auxiliary loss's weight."""
    return {
        experts_key: model.moe.num_experts,
        "num_experts_per_tok": model.moe.top_k,
        "router_aux_loss_coef": model.moe.aux_loss_coef,
        "output_router_logits": False,
    }


def check_exportable(model: ModelConfig, architecture: str) -> None:
    """ConfigError unless transformers' `architecture` computes what model.moe does."""
    moe = model.moe
    for key, value, supported in (
        ("score", moe.score, "softmax"),
        ("capacity_factor", moe.capacity_factor, None),
    ):
        if value != supported:
            raise ConfigError(
                f"model.moe.{key}={value} cannot be exported as model.family={model.family} "
                f"({architecture} routes with {key}={supported}); set model.moe.{key}="
                f"{'null' if supported is None else supported}"
            )
