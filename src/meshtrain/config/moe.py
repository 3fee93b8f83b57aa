"""model.moe: a mixture-of-experts feed-forward layer in place of the dense MLP (sparse MoE, as
Mixtral's and Qwen3-MoE's): a router sends each token to top_k of num_experts gated MLPs. The
schema of the keys and their start-up checks, each failure one line naming the key, the value and
the fix. The layer itself is meshtrain.models.moe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from meshtrain.errors import did_you_mean, require

Score = Literal["softmax", "sigmoid"]
"""model.moe.score: how the router turns its logits into scores."""


@dataclass
class MoeConfig:
    """model.moe (every block's MLP becomes a mixture of experts when num_experts > 0)."""

    num_experts: int = 0
    """Experts E per layer (Hugging Face num_experts, Mixtral's num_local_experts); 0: a dense MLP, no MoE."""
    top_k: int = 2
    """Experts K each token is sent to (Hugging Face num_experts_per_tok)."""
    expert_dim: int = 0
    """Hidden width F of one expert (Hugging Face moe_intermediate_size; Mixtral's intermediate_size); required with num_experts > 0."""
    score: str = "softmax"  # Score
    """Router scores from its logits: softmax over all experts (Mixtral, Qwen3-MoE) or sigmoid of each (DeepSeek-V3 style); the top_k highest scores pick the experts."""
    normalize_top_k: bool = True
    """Renormalise the top_k picked scores to sum to 1 (Mixtral always does; Qwen3-MoE's norm_topk_prob, false in its config class, true in the released checkpoints); false: the scores weigh the experts as they are."""
    capacity_factor: float | None = None
    """null: dropless, every expert takes every token routed to it. A number c: each expert takes at most ceil(c · tokens · top_k / num_experts) of its assignments, first come first served in token order; the rest are dropped (they add nothing, the residual carries the token) and counted."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss (Switch Transformer's, as Hugging Face's load_balancing_loss_func; Hugging Face router_aux_loss_coef, 0.001 in Mixtral's and Qwen3-MoE's configs) added to the training loss; 0: none."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE: mean over tokens of logsumexp(router logits)², which keeps the logits small) added to the training loss; 0: none."""


def moe_enabled(moe: MoeConfig) -> bool:
    return moe.num_experts > 0


def check_moe(moe: MoeConfig) -> None:
    """The model.moe keys on their own."""
    if moe.num_experts == 0:
        changed = [
            f"model.moe.{key}"
            for key, default in MOE_DEFAULTS.items()
            if getattr(moe, key) != default
        ]
        require(
            not changed,
            f"{', '.join(changed)} set but model.moe.num_experts=0 (a dense MLP); set "
            "model.moe.num_experts (e.g. 8) for a mixture of experts, or drop those keys",
        )
        return
    require(
        moe.num_experts > 0,
        f"model.moe.num_experts={moe.num_experts} must be positive (e.g. 8), or 0 for a dense MLP",
    )
    require(
        moe.top_k >= 1,
        f"model.moe.top_k={moe.top_k} must be at least 1; set model.moe.top_k between 1 and "
        f"model.moe.num_experts={moe.num_experts} (e.g. 2)",
    )
    require(
        moe.top_k <= moe.num_experts,
        f"model.moe.top_k={moe.top_k} exceeds model.moe.num_experts={moe.num_experts}; set "
        f"model.moe.top_k <= {moe.num_experts}",
    )
    require(
        moe.expert_dim > 0,
        f"model.moe.expert_dim={moe.expert_dim} must be positive with model.moe.num_experts="
        f"{moe.num_experts}; set it to one expert's hidden width (Hugging Face "
        "moe_intermediate_size, Mixtral's intermediate_size)",
    )
    options = get_args(Score)
    require(
        moe.score in options,
        f"model.moe.score={moe.score!r} is not one of {', '.join(options)}"
        f"{did_you_mean(str(moe.score), options)}",
    )
    require(
        not (moe.top_k == 1 and moe.normalize_top_k),
        "model.moe.normalize_top_k=true with model.moe.top_k=1 makes every routing weight 1, so "
        "the router learns from no loss but the auxiliary ones; set model.moe.normalize_top_k="
        "false (Switch Transformer) or model.moe.top_k >= 2",
    )
    require(
        moe.capacity_factor is None or moe.capacity_factor > 0,
        f"model.moe.capacity_factor={moe.capacity_factor} must be positive (e.g. 1.25), or null "
        "for dropless routing",
    )
    for key in ("aux_loss_coef", "z_loss_coef"):
        value = getattr(moe, key)
        require(
            value >= 0,
            f"model.moe.{key}={value} must be >= 0 (e.g. 0.001), or 0 for no such loss",
        )


MOE_DEFAULTS = {
    key: getattr(MoeConfig(), key)
    for key in (
        "top_k",
        "expert_dim",
        "score",
        "normalize_top_k",
        "capacity_factor",
        "aux_loss_coef",
        "z_loss_coef",
    )
}
