"""The context parallelism keys against the mesh: a sequence split over cp
(meshtrain.parallel.context) needs a length that cuts into two chunks per cp device, and
refuses what cannot run on such a split. Each failure is a one-line ConfigError with the fix."""

from __future__ import annotations

from meshtrain.config.schema import Config
from meshtrain.errors import require
from meshtrain.parallel.context import check_context_length, sequence_axes, sequence_shards
from meshtrain.parallel.mesh import MeshSpec


def check_context_parallel(cfg: Config, mesh: MeshSpec) -> None:
    """A mesh that splits sequences (cp > 1): data.seq_len in 2·cp equal chunks; no pp axis
    (the pipeline stages cannot yet run the cp attention inside them); no LoRA dropout (its
    masks are drawn per sequence in order); model.attention not cudnn (models.attention)."""
    rules = cfg.model.logical_axis_rules
    shards = sequence_shards(mesh.sizes, rules)
    if shards == 1:
        return
    split = "×".join(sequence_axes(mesh.sizes, rules))
    check_context_length(cfg.data.seq_len, shards)
    require(
        mesh.sizes["pp"] == 1,
        f"model.mesh_shape splits sequences over {split}={shards} and layers over "
        f"pp={mesh.sizes['pp']}: context parallelism does not run inside pipeline stages yet; "
        "drop one of the two axes (put its devices on fsdp or dp)",
    )
    lora = cfg.model.lora
    require(
        lora.rank == 0 or lora.dropout == 0,
        f"model.lora.dropout={lora.dropout} with {split}={shards} in model.mesh_shape: adapter "
        "dropout is drawn per sequence in order, not per cp chunk; drop model.lora.dropout, "
        "or train on a mesh without cp",
    )
