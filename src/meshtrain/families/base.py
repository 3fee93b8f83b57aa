"""What a model family declares: its Hugging Face architecture and config.json defaults, the
ModelConfig fields its architecture fixes, the features it can express, and its block's
parameter vocabulary (families.vocabulary). Generic code reads the declaration: the HF config
mapping both ways (hf.config_json), the tensor map (hf.tensor_map), PEFT's adapter names
(hf.peft), LoRA's targets (config.lora), QLoRA's blocked axes (models.frozen) and the FLOPs per
token (observe.flops). Nothing outside meshtrain.families names a family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from meshtrain.families.vocabulary import DENSE_BLOCK, ModelConfig, Projection

ExportFields = Callable[[ModelConfig, list[str]], dict[str, Any]]
"""(model, the kind of each layer: global or local) → this family's own config.json keys."""
ReadFields = Callable[[dict[str, Any], str], dict[str, Any]]
"""(config.json's language model keys with the family's defaults, its source for errors) →
ModelConfig fields of this family's own (a mixture of experts': "moe")."""


def no_fields(model: ModelConfig, kinds: list[str]) -> dict[str, Any]:
    return {}


def read_nothing(text: dict[str, Any], source: str) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    """A registered model family (families.REGISTERED); `model.family` names it."""

    name: str
    """model.family."""
    architecture: str
    """transformers' class, config.json's `architectures`: LlamaForCausalLM."""
    model_type: str
    """config.json's model_type, written and read."""
    hf_defaults: Mapping[str, Any]
    """The defaults of transformers' config class for the keys meshtrain reads (published
    configs leave some out and rely on them)."""
    features: Mapping[str, Any]
    """The ModelConfig fields its architecture fixes (qk_norm, post_norms, ...): read from no
    config.json, and refused on export when a model differs."""
    also_reads: tuple[str, ...] = ()
    """Other model_types read as this family: a multimodal checkpoint whose text_config holds it."""
    projections: tuple[Projection, ...] = DENSE_BLOCK
    """The block's projections, in order (attention, then feed-forward)."""
    activation_key: str = "hidden_act"
    """The config.json key of the MLP's activation."""
    sliding_layers: bool = False
    """It can have local (sliding-window) layers, with their own RoPE base."""
    attention_scale: bool = False
    """Its config.json sets the attention scale (query_pre_attn_scalar)."""
    export_fields: ExportFields = field(default=no_fields)
    """Its own config.json keys on export (beside the ones every family writes)."""
    read_fields: ReadFields = field(default=read_nothing)
    """Its own ModelConfig fields from config.json (beside the ones every family reads)."""

    @property
    def mixture_of_experts(self) -> bool:
        """Its feed-forward is a mixture of experts (models.moe), its weights one per expert."""
        return any(p.leading for p in self.projections)

    @property
    def projection(self) -> dict[str, Projection]:
        """The block's projections by name."""
        return {p.name: p for p in self.projections}
