"""The model's dimensions against the mesh axes that shard them (heads, MLP, vocabulary, a
mixture of experts' experts and their width), each misfit one line naming the sizes that work."""

from __future__ import annotations

from meshtrain.config.schema import ModelConfig
from meshtrain.errors import ConfigError
from meshtrain.parallel.mesh import MeshSpec
from meshtrain.parallel.rules import mesh_axes_for


def _divisors_of_all(values: list[int]) -> list[int]:
    return [d for d in range(1, min(values) + 1) if all(v % d == 0 for v in values)]


def check_model_on_mesh(model: ModelConfig, mesh: MeshSpec) -> None:
    """The model's heads, MLP and vocabulary divide over the mesh axes that shard them (key/value
    heads that tp cannot split are replicated instead); else one line naming the model, its head
    counts and the sizes that would work."""
    rules = model.logical_axis_rules
    tp_dims = {
        "num_heads": (model.num_heads, "heads"),
        "num_kv_heads": (model.num_kv_heads, "kv_heads"),
        "mlp_dim": (model.mlp_dim, "mlp"),
        "vocab_size": (model.vocab_size, "vocab"),
    }
    if model.moe.num_experts > 0:
        tp_dims["moe.num_experts"] = (model.moe.num_experts, "experts")
        tp_dims["moe.expert_dim"] = (model.moe.expert_dim, "expert_mlp")
    elif mesh.sizes["ep"] > 1:
        raise ConfigError(
            f"ep={mesh.sizes['ep']} in model.mesh_shape splits the experts of a mixture of "
            f"experts, but model {model.name} has none (model.moe.num_experts=0); put those "
            "devices on dp or fsdp"
        )
    if mesh_axes_for("kv_heads", rules) == mesh_axes_for("heads", rules):
        # More tp ranks than key/value heads: they are replicated (models.abstract.fit_kv_heads).
        del tp_dims["num_kv_heads"]
    for key, (dim, logical) in tp_dims.items():
        axes = mesh_axes_for(logical, rules)
        shards = mesh.size(*axes)
        if dim % shards:
            names = "×".join(axes)
            split = {k: d for k, (d, lg) in tp_dims.items() if mesh_axes_for(lg, rules) == axes}
            options = ", ".join(str(d) for d in _divisors_of_all(list(split.values())))
            heads = (
                f"; model {model.name} has {model.num_heads} query heads and "
                f"{model.num_kv_heads} key/value head(s)"
                if key == "num_heads"
                else ""
            )
            raise ConfigError(
                f"{names}={shards} in model.mesh_shape does not divide model.{key}={dim}{heads}; "
                f"use {names} in {{{options}}} (divisors of "
                + ", ".join(f"model.{k}={d}" for k, d in split.items())
                + ")"
            )
