"""Trains 2 steps on combinations of mesh layout, pipeline schedule, global batch, gradient
accumulation and remat over 8 faked CPU devices, and checks that each either gives the losses
of the same run on an fsdp-only mesh (relative 1e-5) or is refused by a one-line config error
before anything is compiled. No combination may abort, hang or print a C++ stack.

    python scripts/checks/sweep_parallelism.py [--cases N] [--all] [--only TEXT] [--skip TEXT] [--json]

The product: every layout of 8 devices over 2 or 3 of the axes dp, pp, fsdp, cp, tp (30 meshes) ×
the schedules that apply (none without pp; gpipe, circular and 1f1b with it) × the global batch
(the smallest the mesh accepts, and 2× or 4× it) × accumulation 1 and 2 × remat none and full,
with the layers in a scan: 464 cases (cp with pp is refused in one line). Without --all, N of them (default 40): every mesh and
schedule once, the other settings rotating, then a seeded sample of the rest; the list is
printed first; --only keeps the cases whose line contains TEXT (e.g. '[pp,fsdp]' or
'1f1b'), --skip (repeatable) drops them. The model is the tiny one with 4 layers of alternating local and global attention
on synthetic data of 32 tokens. Exit code 1 if a case's losses differ or a refusal is not one
line; the process dying is the other failure (the last "case" line names the culprit).
tests/train/test_parallel_sweep.py runs it in the slow set (CI).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DEVICES = 8
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
)

REPO = Path(__file__).resolve().parents[2]
AXES = ("dp", "pp", "fsdp", "cp", "tp")
MODEL = (
    "model.num_layers=4",
    "model.scan_layers=true",
    "model.attention_pattern=[local,global]",
    "model.sliding_window=8",
)
RUN = (
    "data=synthetic",
    "data.seq_len=32",
    "training.steps=2",
    "training.log_every=1",
    "training.warmup_steps=1",
    "training.eval_every=0",
    "checkpoint.every_steps=1000",
    "checkpoint.async_save=false",
)
RTOL = 1e-5


@dataclass(frozen=True)
class Case:
    """One combination of the sweep."""

    sizes: tuple[int, ...]
    axes: tuple[str, ...]
    schedule: str  # none, gpipe, circular, 1f1b
    batch_factor: int  # 1: the smallest global batch the mesh accepts; 2 or 4: that many times
    accumulation: int
    remat: str

    @property
    def mesh_shape(self) -> str:
        return f"[[{','.join(map(str, self.sizes))}],[{','.join(self.axes)}]]"

    def overrides(self, global_batch: int) -> list[str]:
        pipeline = (
            [] if self.schedule == "none" else [f"training.pipeline.schedule={self.schedule}"]
        )
        return [
            *MODEL,
            *RUN,
            f"model.mesh_shape={self.mesh_shape}",
            f"model.remat={self.remat}",
            f"training.gradient_accumulation_steps={self.accumulation}",
            f"training.global_batch_size={global_batch}",
            *pipeline,
        ]

    def __str__(self) -> str:
        return (
            f"{self.mesh_shape} {self.schedule} batch×{self.batch_factor} "
            f"accumulation {self.accumulation} remat {self.remat}"
        )


def meshes() -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every layout of DEVICES over 2 or 3 axes of size > 1, axes in the mesh's order."""
    layouts = []
    for count in (2, 3):
        for axes in itertools.combinations(AXES, count):
            for sizes in itertools.product((2, 4), repeat=count):
                if math.prod(sizes) == DEVICES:
                    layouts.append((sizes, axes))
    return layouts


def all_cases() -> list[Case]:
    cases = []
    for sizes, axes in meshes():
        schedules = ("gpipe", "circular", "1f1b") if "pp" in axes else ("none",)
        for schedule, factor, accumulation, remat in itertools.product(
            schedules, (1, 2), (1, 2), ("none", "full")
        ):
            cases.append(Case(sizes, axes, schedule, factor, accumulation, remat))
    return cases


def sample(cases: list[Case], count: int, seed: int = 0) -> list[Case]:
    """Every mesh and schedule once (the other settings rotating with its index), then a seeded
    sample of the rest, up to `count` cases."""
    combos = list(dict.fromkeys((c.sizes, c.axes, c.schedule) for c in cases))
    chosen = []
    for i, (sizes, axes, schedule) in enumerate(combos):
        factor, accumulation, remat = (
            (1, 2)[i % 2],
            (1, 2)[(i // 2) % 2],
            ("none", "full")[(i // 4) % 2],
        )
        chosen.append(Case(sizes, axes, schedule, factor, accumulation, remat))
    rest = [c for c in cases if c not in chosen]
    extra = random.Random(seed).sample(rest, max(0, min(len(rest), count - len(chosen))))
    return [*chosen, *extra]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=40, help="cases to sample (default 40)")
    parser.add_argument("--all", action="store_true", help="run all 272 cases")
    parser.add_argument("--only", help="only the cases whose line contains this text")
    parser.add_argument(
        "--skip", action="append", default=[], help="drop the cases whose line contains this text"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per case")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from meshtrain.config.hydra import compose_config
    from meshtrain.config.validate import check_against_mesh, check_config, micro_batch_size
    from meshtrain.errors import ConfigError
    from meshtrain.parallel.mesh import parse_mesh_shape
    from meshtrain.train.loop import train

    def smallest_batch(case: Case) -> tuple[int | None, str | None]:
        """The smallest global batch the case's mesh accepts, or, where none up to 64
        sequences per device is, the refusal of the largest (the one whose reason is not
        the batch size)."""
        last_error = None
        for batch in range(case.accumulation, 64 * DEVICES + 1, case.accumulation):
            cfg = compose_config(*case.overrides(batch))
            try:
                check_config(cfg)
                mesh = parse_mesh_shape(cfg.model.mesh_shape, DEVICES)
                check_against_mesh(cfg, mesh)
                micro_batch_size(cfg, mesh)
                return batch, None
            except ConfigError as err:
                last_error = str(err)
        return None, last_error

    references: dict[tuple[int, int, str], list[float]] = {}

    def reference(batch: int, accumulation: int, remat: str, work: Path) -> list[float]:
        """The losses of the same run on fsdp alone, over as many devices as the batch splits
        into (a power of 2, at most DEVICES)."""
        key = (batch, accumulation, remat)
        if key not in references:
            fsdp = DEVICES
            while (batch // accumulation) % fsdp:
                fsdp //= 2
            case = Case((fsdp, 1), ("fsdp", "tp"), "none", 1, accumulation, remat)
            result = train(
                compose_config(*case.overrides(batch)),
                work / f"reference-{batch}-{accumulation}-{remat}",
                devices=jax.devices()[:fsdp],
            )
            references[key] = [h["loss"] for h in result.history]
        return references[key]

    cases = all_cases() if args.all else sample(all_cases(), args.cases)
    cases = [c for c in cases if args.only is None or args.only in str(c)]
    cases = [c for c in cases if not any(text in str(c) for text in args.skip)]
    print(f"sweep: {len(cases)} of {len(all_cases())} cases on {DEVICES} devices", flush=True)
    for i, case in enumerate(cases, 1):
        print(f"  {i:3d}. {case}", flush=True)

    failures, counts = 0, {"match": 0, "refused": 0}
    with tempfile.TemporaryDirectory(prefix="meshtrain-sweep-") as tmp:
        work = Path(tmp)
        for i, case in enumerate(cases, 1):
            print(f"case {i}/{len(cases)}: {case}", flush=True)
            start = time.perf_counter()
            smallest, refusal = smallest_batch(case)
            record = {"case": asdict(case), "mesh_shape": case.mesh_shape}
            if smallest is None:
                outcome, detail = "refused", refusal
            else:
                batch = smallest * case.batch_factor
                record["global_batch"] = batch
                try:
                    result = train(compose_config(*case.overrides(batch)), work / f"case{i}")
                except ConfigError as err:
                    outcome, detail = "refused", str(err)
                else:
                    losses = [h["loss"] for h in result.history]
                    expected = reference(batch, case.accumulation, case.remat, work)
                    error = float(np.max(np.abs(np.subtract(losses, expected)) / np.abs(expected)))
                    record.update(losses=losses, reference=expected, relative_error=error)
                    outcome = "match" if error <= RTOL else "differ"
                    detail = f"losses {losses} against {expected} (relative {error:.1e})"
            if outcome == "refused" and "\n" in (detail or ""):
                outcome = "refused in more than one line"
            record.update(outcome=outcome, detail=detail, seconds=time.perf_counter() - start)
            if outcome in counts:
                counts[outcome] += 1
            else:
                failures += 1
            if args.json:
                print(json.dumps(record), flush=True)
            print(f"  → {outcome}: {detail}", flush=True)
    print(
        f"sweep: {len(cases)} cases, {counts['match']} match, {counts['refused']} refused, "
        f"{failures} failed",
        flush=True,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    sys.exit(main())
