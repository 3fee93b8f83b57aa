"""Prints the table of model configs for docs/models.md: architecture and parameter count (a
mixture of experts' MLP as its experts × their width and the experts per token).

python scripts/docs/model_table.py
"""

from __future__ import annotations

import sys

from meshtrain.config.hydra import compose_config
from meshtrain.models.transformer import parameter_count

ORDER = [
    "gemma3_270m",
    "gemma3_1b",
    "gemma3_4b",
    "gemma3_12b",
    "gemma3_27b",
    "llama3_1b",
    "llama3_3b",
    "llama3_8b",
    "qwen3_0_6b",
    "qwen3_1_7b",
    "qwen3_4b",
    "qwen3_8b",
    "qwen3_30b_a3b",
    "mixtral_8x7b",
]


def row(name: str) -> str:
    m = compose_config(f"model={name}").model
    attention = "global"
    if "local" in m.attention_pattern:
        local = m.attention_pattern.count("local")
        attention = (
            f"{local} local ({m.sliding_window}) : {len(m.attention_pattern) - local} global"
        )
    rope = f"{m.rope_theta:,.0f}"
    if m.rope_local_theta is not None:
        rope += f" / local {m.rope_local_theta:,.0f}"
    if m.rope_scaling != "none":
        rope += f", {m.rope_scaling} ×{m.rope_scaling_factor:g}"
    mlp = str(m.mlp_dim)
    if m.moe.num_experts:  # a mixture of experts: E experts of width F, top-k per token
        mlp = f"{m.moe.num_experts} × {m.moe.expert_dim}, top {m.moe.top_k}"
    return (
        f"| `model={name}` | {m.num_layers} | {m.d_model} | {m.num_heads}/{m.num_kv_heads} | "
        f"{m.head_dim} | {mlp} | {m.vocab_size:,} | {m.max_seq_len:,} | {attention} | "
        f"{rope} | {'yes' if m.tie_embeddings else 'no'} | {parameter_count(m):,} |"
    )


def main() -> None:
    print(
        "| config | layers | d_model | heads q/kv | head_dim | mlp_dim | vocab | context "
        "| attention (window) | RoPE base, scaling | tied | parameters |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in sys.argv[1:] or ORDER:
        print(row(name))


if __name__ == "__main__":
    main()
