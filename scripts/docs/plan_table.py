"""Prints the planner's numbers next to the rules of thumb in docs/planning.md (scaling calculator).

    python scripts/docs/plan_table.py            # tiny model on 1 and 8 faked devices (~1 minute)
    python scripts/docs/plan_table.py --large    # and the 8B-parameter config on 16 (several minutes)

Each row is a dry run (`training.dry_run=true`): the real train step compiled on abstract inputs
for faked CPU devices. Nothing is trained and no weights are allocated.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import jax

MAX_DEVICES = 16
# Llama 3.1 8B, as in docs/planning.md.
LARGE = ("model=llama3_8b",)
TINY_ROWS = [
    ("tiny", "[[1,1],[fsdp,tp]]", ("training.micro_batch_size=8",)),
    ("tiny", "[[8,1],[fsdp,tp]]", ("training.micro_batch_size=1",)),
    ("tiny", "[[4,2],[fsdp,tp]]", ("training.micro_batch_size=2",)),
    ("tiny", "[[2,4],[dp,fsdp]]", ("training.micro_batch_size=1",)),
]
LARGE_ROWS = [
    ("8B fp32", "[[16,1],[fsdp,tp]]", ("training.micro_batch_size=1", *LARGE)),
    ("8B fp32", "[[8,2],[fsdp,tp]]", ("training.micro_batch_size=1", *LARGE)),
    (
        "8B bf16",
        "[[16,1],[fsdp,tp]]",
        ("training.micro_batch_size=1", "training.mixed_precision=bf16", *LARGE),
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="also plan the 8B config")
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", MAX_DEVICES)
    from meshtrain.config.hydra import compose_config
    from meshtrain.train.dry_run import dry_run
    from meshtrain.units import format_bytes as gib

    logging.disable(logging.INFO)
    rows = TINY_ROWS + (LARGE_ROWS if args.large else [])
    print(
        "| model | mesh | params | 4× params (Adam fp32) | params+grads+Adam | "
        "activations+temps | total | all-gather | grad reduction (ring / ideal) | other collectives |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, mesh, overrides in rows:
        cfg = compose_config(
            f"model.mesh_shape={mesh}", "training.profile_communication=true", *overrides
        )
        sizes = [int(s) for s in mesh[2:].split("]")[0].split(",")]
        devices = jax.devices()[: sizes[0] * sizes[1]]
        with tempfile.TemporaryDirectory() as tmp:
            plan = dry_run(cfg, Path(tmp), devices=devices)
            summary = json.loads((Path(tmp) / "communication.json").read_text())["summary"]
        gather = sum(r["ring_bytes_per_step"] for r in summary if r["kind"] == "all-gather")
        grads = [
            r
            for r in summary
            if r["ideal_kind"] == "reduce-scatter" or r["kind"] == "reduce-scatter"
        ]
        ring = sum(r["ring_bytes_per_step"] for r in grads)
        ideal = sum(r["ideal_bytes_per_step"] for r in grads)
        other = plan.collective_bytes_per_step - gather - ring
        state = plan.params_bytes + plan.grad_bytes + plan.opt_state_bytes
        print(
            f"| {name} | `{mesh}` | {gib(plan.params_bytes)} | {gib(4 * plan.params_bytes)} | "
            f"{gib(state)} | {gib(plan.activation_bytes)} | {gib(plan.total_bytes)} | "
            f"{gib(gather)} | {gib(ring)} / {gib(ideal)} | {gib(other)} |",
            flush=True,
        )
    print("\nAll sizes per device; collectives per device per step (ring algorithm).")


if __name__ == "__main__":
    main()
