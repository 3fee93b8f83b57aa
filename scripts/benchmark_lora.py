"""Full fine-tuning against LoRA and QLoRA (docs/performance.md#lora-and-qlora).

    python scripts/benchmark_lora.py [--models qwen3_0_6b gemma3_1b] [--seq-len 128]
        [--steps 4] [--modes full lora qlora] [--override KEY=VALUE ...] [--json OUT]
    python scripts/benchmark_lora.py --plan [--json OUT]

Without --plan: each model at its published size (random weights: the memory and the time do
not depend on the values) on one CPU device, fp32 compute, short sequences, in three modes, each
in a child process of its own so that its peak resident memory is its own:

    full    every parameter trains (fp32 weights, gradients, two Adam moments)
    lora    rank-16 adapters on q, k, v, o, gate, up, down; the frozen base in bf16
    qlora   the same adapters; the base's projections in nf4 (blocks of 64), the rest in fp32

For each: trainable parameters, the planned step memory (XLA's, plan.json's total), the
process's peak RSS (the CPU backend reports no device peak; it includes JAX's own few hundred
MiB), and the median step time after a warm-up step. The step is built as `python
run_training.py` builds it (scripts/bench/measure.py).

--plan: the planner's answer (training.dry_run, compiled for an H100 with plan.target, checked
against one 24 GB L4 and one 80 GB H100) for llama3_8b at sequence 4096, micro-batch 1, bf16,
remat=full, in the three modes: whether each fits, and the plan's total.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import (
    LLAMA3_8B_ON_H100,
    REPO,
    child_env,
    compose,
    dry_run_plan,
    progress,
    write_results,
)

MODES = {
    "full": [],
    "lora": ["model.lora.rank=16", "model.lora.alpha=32", "model.lora.base_dtype=bf16"],
    "qlora": ["model.lora.rank=16", "model.lora.alpha=32", "model.lora.base_dtype=nf4"],
}


def child(model: str, mode: str, seq_len: int, steps: int, extra: list[str]) -> dict:
    """In the child: build, warm up, time; the numbers of one (model, mode)."""
    import jax
    from bench.measure import MeshtrainStep

    overrides = [
        f"model={model}",
        *extra,
        "data=synthetic",
        f"data.seq_len={seq_len}",
        "model.mesh_shape=[[1,1],[fsdp,tp]]",
        "training.micro_batch_size=1",
        "training.mixed_precision=fp32",
        *MODES[mode],
    ]
    step = MeshtrainStep(compose(overrides), jax.devices()[:1])
    step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    import resource

    count = lambda tree: sum(a.size for a in jax.tree.leaves(tree))  # noqa: E731
    return {
        "model": model,
        "mode": mode,
        "trainable_params": count(step.setup.model.trainable_params),
        "total_params": count(step.setup.model.abstract_params),
        "planned_step_memory_gib": step.planned_memory_gib(),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "step_time_s": statistics.median(times),
        "steps_timed": len(times),
    }


def run_child(model: str, mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", model, mode, str(out)]
        command += ["--seq-len", str(args.seq_len), "--steps", str(args.steps)]
        command += [f"--override={override}" for override in args.override]
        env = {**child_env("W1"), "JAX_PLATFORMS": "cpu"}
        subprocess.run(command, env=env, cwd=REPO, check=True)
        return json.loads(out.read_text())


def plan(mode: str, device: str) -> dict:
    """The dry run's verdict for llama3_8b at sequence 4096 on one `device`."""
    saved, stdout = dry_run_plan(
        [
            *LLAMA3_8B_ON_H100,
            "data.seq_len=4096",
            "model.mesh_shape=[[1,1],[fsdp,tp]]",
            f"plan.device={device}",
            *MODES[mode],
        ]
    )
    verdict = next(line for line in stdout.splitlines() if "verdict:" in line)
    return {
        "model": "llama3_8b",
        "mode": mode,
        "device": device,
        "total_gib": saved["total_bytes"] / 2**30,
        "frozen_gib": saved["frozen_bytes"] / 2**30,
        "fits": saved["fits"],
        "verdict": re.sub(r"^.*verdict: ", "", verdict),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3_0_6b", "gemma3_1b"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--plan", action="store_true")
    parser.add_argument(
        "--override", action="append", default=[], help="a Hydra override for every model run"
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        model, mode, out = args.child
        result = child(model, mode, args.seq_len, args.steps, args.override)
        Path(out).write_text(json.dumps(result))
        return
    results, load_before = [], os.getloadavg()[0]
    if args.plan:
        for device in ("l4", "h100"):
            for mode in args.modes:
                progress(f"planning llama3_8b, {mode}, on one {device}")
                results.append(plan(mode, device))
    else:
        for model in args.models:
            for mode in args.modes:
                progress(f"{model}, {mode}")
                results.append(run_child(model, mode, args))
    for result in results:
        print(json.dumps(result))
    if args.json:
        write_results(args.json, results, load_before)


if __name__ == "__main__":
    main()
