"""The parameter vocabulary of a block: each weight's path, logical axes, Hugging Face tensor
name and layout, PEFT name, and whether a LoRA adapter can sit beside it.

A `Projection` is a weight matrix of a block that a token's hidden state is multiplied by (q, k,
v, o of the attention; gate, up, down of the feed-forward). The layers take their logical axes
from here (models.layers), the HF tensor map and PEFT's adapter names from here (hf.tensor_map,
hf.peft), LoRA's targets and widths (config.lora, models.lora), QLoRA's blocked axis
(models.frozen) and the FLOPs per token (observe.flops) too. A `Norm` is an RMSNorm scale of a
block. A family lists the projections and norms of its block (families.base.Family).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshtrain.families.layouts import HEADS_IN, HEADS_OUT, TRANSPOSE, Layout, PerExpert

ModelConfig = Any
"""meshtrain.config.schema.ModelConfig (read by attribute; the config package imports this one)."""

Widths = Callable[[ModelConfig], tuple[int, int]]


@dataclass(frozen=True)
class Projection:
    """A weight matrix of a block: x [B, T, *in] · w [*in, *out]."""

    name: str
    """Ours, and the name model.lora.targets uses: q."""
    module: str
    """The block's module that holds it: attn."""
    hf_module: str
    """Its module under HF's `layers.{i}.`: self_attn.q_proj (PEFT's target_modules name the last part)."""
    axes: tuple[str, ...]
    """Logical axes of the weight, [*in, *out]."""
    inputs: int
    """How many leading axes are contracted with the hidden state (o: heads and head_dim)."""
    layout: Layout | PerExpert
    """HF's weight → ours (PerExpert: one HF tensor per expert)."""
    adapter_layouts: tuple[Layout, Layout]
    """PEFT's lora_A and lora_B → our A [*in, r] and B [r, *out]."""
    widths: Widths
    """(in, out) widths of the matmul, per token."""
    block_axis: int = 0
    """QLoRA's quantisation blocks run along this axis (the input axis; o: head_dim)."""
    leading: int = 0
    """Leading axes that are neither input nor output (an expert's index): kept on its adapters."""
    active: Callable[[ModelConfig], int] = lambda cfg: 1
    """How many copies of it a token runs through (an expert: top_k)."""
    lora_target: bool = True
    """An adapter can sit beside it (model.lora.targets), and QLoRA quantises it."""

    @property
    def peft_name(self) -> str:
        return self.hf_module.rsplit(".", 1)[-1]

    @property
    def path(self) -> tuple[str, str]:
        """Its path inside a block's parameters: (module, name)."""
        return (self.module, self.name)

    def flops_per_token(self, cfg: ModelConfig) -> int:
        """Forward FLOPs of the matmul per token: 2 · in · out, times the copies it runs."""
        width_in, width_out = self.widths(cfg)
        return 2 * width_in * width_out * self.active(cfg)


@dataclass(frozen=True)
class Norm:
    """An RMSNorm scale of a block: (module path) → HF tensor under `layers.{i}.`."""

    path: tuple[str, ...]
    hf_name: str


def _query(cfg: ModelConfig) -> int:
    return cfg.num_heads * cfg.head_dim


def _key_value(cfg: ModelConfig) -> int:
    return cfg.num_kv_heads * cfg.head_dim


ATTENTION = (
    *(
        Projection(
            name,
            "attn",
            f"self_attn.{name}_proj",
            ("embed", heads, "head_dim"),
            1,
            HEADS_IN,
            (TRANSPOSE, HEADS_IN),
            lambda cfg, width=width: (cfg.d_model, width(cfg)),
        )
        for name, heads, width in (
            ("q", "heads", _query),
            ("k", "kv_heads", _key_value),
            ("v", "kv_heads", _key_value),
        )
    ),
    Projection(
        "o",
        "attn",
        "self_attn.o_proj",
        ("heads", "head_dim", "embed"),
        2,
        HEADS_OUT,
        (HEADS_OUT, TRANSPOSE),
        lambda cfg: (_query(cfg), cfg.d_model),
        block_axis=1,
    ),
)
"""Grouped-query attention's projections (models.layers.Attention)."""

GATED_MLP = tuple(
    Projection(
        name,
        "mlp",
        f"mlp.{name}_proj",
        axes,
        1,
        TRANSPOSE,
        (TRANSPOSE, TRANSPOSE),
        widths,
    )
    for name, axes, widths in (
        ("gate", ("embed", "mlp"), lambda cfg: (cfg.d_model, cfg.mlp_dim)),
        ("up", ("embed", "mlp"), lambda cfg: (cfg.d_model, cfg.mlp_dim)),
        ("down", ("mlp", "embed"), lambda cfg: (cfg.mlp_dim, cfg.d_model)),
    )
)
"""The gated MLP's projections (models.layers.GatedMLP)."""


def mixture_of_experts(module: str, router: str, experts: str, names: dict[str, str]) -> tuple:
    """A mixture of experts' router and experts' gate, up and down (models.moe.MoeFeedForward) as
    a family's checkpoint names them: `module` under `layers.{i}.`, its router `router`, the
    experts under `experts.{expert}.`, each projection's own name in `names` (gate, up, down →
    HF name)."""
    return (
        Projection(
            "router",
            "mlp",
            f"{module}.{router}",
            ("embed", "experts"),
            1,
            TRANSPOSE,
            (TRANSPOSE, TRANSPOSE),
            lambda cfg: (cfg.d_model, cfg.moe.num_experts),
            lora_target=False,
        ),
        *(
            Projection(
                name,
                "mlp",
                f"{module}.{experts}.{{expert}}.{names[name]}",
                ("experts", *axes),
                1,
                PerExpert(TRANSPOSE),
                (TRANSPOSE, TRANSPOSE),
                widths,
                block_axis=1,
                leading=1,
                active=lambda cfg: cfg.moe.top_k,
            )
            for name, axes, widths in (
                ("gate", ("embed", "expert_mlp"), lambda cfg: (cfg.d_model, cfg.moe.expert_dim)),
                ("up", ("embed", "expert_mlp"), lambda cfg: (cfg.d_model, cfg.moe.expert_dim)),
                ("down", ("expert_mlp", "embed"), lambda cfg: (cfg.moe.expert_dim, cfg.d_model)),
            )
        ),
    )


PROJECTION_NAMES = ("q", "k", "v", "o", "gate", "up", "down")
"""Every projection name, in the order of a block; an adapter's dropout key is salted with its
index here (models.lora), so the order is fixed."""

DENSE_BLOCK = ATTENTION + GATED_MLP
"""Attention and a gated MLP: the dense families' block."""


def block_norms(cfg: ModelConfig) -> tuple[Norm, ...]:
    """The RMSNorm scales of a block: QK-norm's where model.qk_norm, and Gemma's sandwich names
    its four by position around the two branches (model.post_norms)."""
    norms = [Norm(("attn_norm", "scale"), "input_layernorm.weight")]
    if cfg.qk_norm:
        norms += [
            Norm(("attn", "q_norm", "scale"), "self_attn.q_norm.weight"),
            Norm(("attn", "k_norm", "scale"), "self_attn.k_norm.weight"),
        ]
    if cfg.post_norms:
        norms += [
            Norm(("attn_post_norm", "scale"), "post_attention_layernorm.weight"),
            Norm(("mlp_norm", "scale"), "pre_feedforward_layernorm.weight"),
            Norm(("mlp_post_norm", "scale"), "post_feedforward_layernorm.weight"),
        ]
    else:  # Llama's "post attention" norm is the one in front of the MLP
        norms.append(Norm(("mlp_norm", "scale"), "post_attention_layernorm.weight"))
    return tuple(norms)
