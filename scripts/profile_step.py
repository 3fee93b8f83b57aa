"""Where a train step's time goes, by kind of work: `python run_training.py` with the given
overrides, profiled (training.profile=true) with XLA's optimised HLO dumped beside, and each
traced operation's time put in a category by what it computes (docs/performance.md).

    python scripts/profile_step.py [--steps 8] [--start 5] [--window 3] [--json OUT] -- overrides...

Categories, from the HLO of the operation (a fusion: the instructions it fuses):
- projections: matrix products of the model's dense weights (and their gradients);
- head and loss: products with the vocabulary as a dimension (the output projection, the fused
  cross-entropy's chunks and their gradients);
- attention: batched products (per head) and the work fused with them;
- adapters: products with model.lora.rank as a dimension (x·A, ·B and their gradients);
- optimizer: what runs after the gradients (the gradient norm and clipping, AdamW's moments,
  the update), the operations jax did not trace under the loss's jvp;
- copies and layout: copy, transpose and their fusions;
- other: everything else (norms, activations, residual adds, casts, reductions...).
Each category's operation time per traced step (the mean over the window; summed over the
threads XLA's CPU runtime runs independent operations on, so it can exceed the wall time), next
to its matrix product FLOPs (observe.hlo) and the rate they ran at; and the untraced wall time
of a step (the median of the logged steps outside the window, after the second).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTAINERS = ("while", "conditional", "call")  # operations that run other computations
CATEGORIES = (
    "projections",
    "head and loss",
    "attention",
    "adapters",
    "optimizer",
    "copies and layout",
    "other",
)


def run_profiled(work: Path, overrides: list[str], steps: int, start: int, window: int) -> Path:
    """Runs the training with the profiler on and XLA's HLO dumped in `work`; its run dir."""
    run_dir = work / "run"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_dump_to={work / 'hlo'} --xla_dump_hlo_as_text "
        "--xla_dump_hlo_module_re=jit_step"
    ).strip()
    command = [
        sys.executable,
        str(REPO / "run_training.py"),
        *overrides,
        f"training.steps={steps}",
        "training.profile=true",
        f"profile.start_step={start}",
        f"profile.num_steps={window}",
        "training.eval_every=0",
        "checkpoint.every_steps=0",
        "training.compilation_cache_dir=null",  # compiled here, so that XLA dumps its HLO
        f"hydra.run.dir={run_dir}",
    ]
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return run_dir


def optimised_module(hlo_dir: Path) -> str:
    """The text of the train step's module after XLA's optimisations (the largest, if several
    compiled)."""
    dumps = sorted(
        hlo_dir.glob("*.jit_step.*after_optimizations.txt"), key=lambda p: p.stat().st_size
    )
    if not dumps:
        raise SystemExit(f"no optimised train step HLO in {hlo_dir}")
    return dumps[-1].read_text()


def categorise(module, rank: int | None, vocab: int) -> dict[str, str]:
    """Top-level instruction name → its category (see the module docstring)."""

    def dots(instruction) -> list:
        found = [instruction] if instruction.opcode == "dot" else []
        for callee in instruction.callees:
            for inner in module.computations.get(callee, []):
                found += dots(inner)
        return found

    return {
        instruction.name: _category(module, instruction, dots(instruction), rank, vocab)
        for instructions in module.computations.values()
        for instruction in instructions
    }


def _category(module, instruction, dots: list, rank: int | None, vocab: int) -> str:
    if dots:
        dims = {
            d
            for dot in dots
            for array in (dot.shape[0], *(module.by_name[o].shape[0] for o in dot.operands[:2]))
            for d in array.dims
        }
        if rank is not None and rank in dims:
            return "adapters"
        if vocab in dims:
            return "head and loss"
        return (
            "attention" if any(dot.attribute("lhs_batch_dims") for dot in dots) else "projections"
        )
    if instruction.op_name.startswith("jit(step)/") and "jvp(" not in instruction.op_name:
        return "optimizer"  # after the gradients (jax traces the loss and them under jvp)
    if instruction.opcode in ("copy", "transpose") or instruction.name.startswith(
        ("copy", "transpose")
    ):
        return "copies and layout"
    return "other"


def attribute(run_dir: Path, hlo_text: str, rank: int | None, vocab: int, window: int) -> dict:
    """Each category's seconds per traced step, share, matrix product FLOPs and their rate."""
    from meshtrain.observe.hlo import dot_flops, matmul_flops, parse_module
    from meshtrain.observe.trace import find_trace, op_events

    module = parse_module(hlo_text)
    categories = categorise(module, rank, vocab)
    trace = find_trace(run_dir / "profile")
    if trace is None:
        raise SystemExit(f"no trace under {run_dir / 'profile'}")
    seconds: dict[str, float] = defaultdict(float)
    for events in op_events(trace, module.name).values():
        for op, start, end in events:
            instruction = module.by_name.get(op)
            if instruction is not None and instruction.opcode in CONTAINERS:
                continue  # its operations are events of their own
            seconds[categories.get(op, "other")] += (end - start) / 1e9 / window
    counts, _ = module.execution_counts()
    flops: dict[str, float] = defaultdict(float)
    for computation, instructions in module.computations.items():
        for dot in (i for i in instructions if i.opcode == "dot"):
            kind = _category(module, dot, [dot], rank, vocab)
            flops[kind] += dot_flops(module, dot) * counts.get(computation, 0)
    total = sum(seconds.values())
    return {
        "op_s": total,
        "matmul_flops": matmul_flops(module),
        "categories": {
            c: {
                "seconds": seconds.get(c, 0.0),
                "share": seconds.get(c, 0.0) / total if total else 0.0,
                "gflops": flops.get(c, 0.0) / 1e9,
                "gflop_per_s": flops[c] / 1e9 / seconds[c]
                if seconds.get(c) and flops.get(c)
                else None,
            }
            for c in CATEGORIES
        },
    }


def untraced_step_time(run_dir: Path, start: int, window: int) -> float:
    """The median logged step time of the steps after the second, outside the traced window."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    traced = range(start, start + window)
    return statistics.median(
        r["step_time_s"] for r in records if r["step"] > 2 and r["step"] not in traced
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--start", type=int, default=5, help="first traced step")
    parser.add_argument("--window", type=int, default=3, help="traced steps")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    from meshtrain.config.hydra import compose_config

    cfg = compose_config(*args.overrides, config_dir=REPO / "configs")
    rank = cfg.model.lora.rank or None
    with tempfile.TemporaryDirectory(prefix="meshtrain-profile-") as work:
        run_dir = run_profiled(Path(work), args.overrides, args.steps, args.start, args.window)
        result = attribute(
            run_dir, optimised_module(Path(work) / "hlo"), rank, cfg.model.vocab_size, args.window
        )
        result["wall_step_s"] = untraced_step_time(run_dir, args.start, args.window)
    result["overrides"] = args.overrides
    print(
        f"step {result['wall_step_s']:.3f} s (untraced), operations {result['op_s']:.3f} s "
        f"(traced, summed over threads), {result['matmul_flops'] / 1e9:.1f} GFLOP of matmuls"
    )
    for name, row in result["categories"].items():
        rate = f"{row['gflop_per_s']:.1f} GFLOP/s" if row["gflop_per_s"] else ""
        print(
            f"  {name:18s} {row['seconds']:7.3f} s {row['share']:6.1%} {row['gflops']:8.2f} GFLOP {rate}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
