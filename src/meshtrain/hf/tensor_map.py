"""Which Hugging Face tensor holds each meshtrain parameter, and how its layout differs
(families.layouts): the embedding, final norm and head, and each block's norms and projections
as its family declares them (families.vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable

from meshtrain.config import ModelConfig
from meshtrain.families import family
from meshtrain.families.layouts import COPY, TRANSPOSE, Layout, PerExpert, expert_names
from meshtrain.families.vocabulary import block_norms

# Key prefixes of the language model's tensors: a CausalLM checkpoint; a Gemma 3 multimodal
# checkpoint as saved by transformers >= 4.52 and by the 4.50 that published them.
MODEL_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
ParamPath = tuple[str | int, ...]


def layer_tensors(cfg: ModelConfig) -> dict[ParamPath, tuple[str, Layout | PerExpert]]:
    """Path inside one block → (HF name under `layers.{i}.`, layout)."""
    tensors: dict[ParamPath, tuple[str, Layout | PerExpert]] = {
        norm.path: (norm.hf_name, COPY[1]) for norm in block_norms(cfg)
    }
    for projection in family(cfg.family).projections:
        tensors[projection.path] = (f"{projection.hf_module}.weight", projection.layout)
    return tensors


def hf_tensors(
    cfg: ModelConfig, prefix: str = "model."
) -> dict[ParamPath, tuple[str, Layout | PerExpert]]:
    """Path of every parameter in the unstacked layout (blocks indexed by layer) → (full HF name,
    layout); `prefix` is where the checkpoint keeps the language model (MODEL_PREFIXES). A
    PerExpert parameter's name holds {expert}: one HF tensor per expert (hf_entries)."""
    tensors: dict[ParamPath, tuple[str, Layout | PerExpert]] = {
        ("embed",): (f"{prefix}embed_tokens.weight", COPY[2]),
        ("final_norm", "scale"): (f"{prefix}norm.weight", COPY[1]),
    }
    if not cfg.tie_embeddings:
        tensors[("lm_head",)] = ("lm_head.weight", TRANSPOSE)
    for i in range(cfg.num_layers):
        for path, (name, layout) in layer_tensors(cfg).items():
            tensors[("blocks", i, *path)] = (f"{prefix}layers.{i}.{name}", layout)
    return tensors


def hf_entries(
    tensors: dict[ParamPath, tuple[str, Layout | PerExpert]],
    shape_of: Callable[[ParamPath], tuple[int, ...]],
) -> list[tuple[str, ParamPath, int | None, Layout, tuple[int, ...]]]:
    """Every HF tensor of `tensors`, in order: (its name, our parameter's path, the expert it
    holds of a PerExpert parameter or None, its layout against our [*rest], its HF shape);
    shape_of(path) is our parameter's shape in the unstacked layout."""
    entries = []
    for path, (name, layout) in tensors.items():
        shape = shape_of(path)
        if isinstance(layout, PerExpert):
            hf_shape = layout.hf_shape(shape)
            for expert, hf_name in enumerate(expert_names(name, shape[0])):
                entries.append((hf_name, path, expert, layout.inner, hf_shape))
        else:
            entries.append((name, path, None, layout, layout.hf_shape(shape)))
    return entries
