"""Compile models for a GPU this machine lacks, and check the compiles against budgets.

    python scripts/checks/compile_for.py --target h100 [--model gemma3_1b llama3_1b qwen3_0_6b]
        [--micro-batch 8] [--budget-init 30] [--budget-step 90] [--json] [-- overrides...]

Each model's dry run (`training.dry_run=true plan.target=<target>`, docs/planning.md) runs in a
child process at W4's settings (bf16, sequence 4096, one GPU: docs/performance.md; further Hydra
overrides after `--`): its initialisation and train step are compiled for the target on this
host's CPU, with no autotuning. It prints, per model, the compile times, the fusions, the
attention kernel, the cuDNN attention calls and XLA's memory plan against the GPU's memory, then
fails (exit 1) naming what broke when an initialisation or step compiles slower than its budget,
a step has more than --fusion-ratio × llama3_1b's fusions per layer (when llama3_1b is among the
models; unscanned, a step grows with depth), or a plan does not fit. The fusions are the gate,
not the compile time per layer: they are the same on every machine, and they are what exploded
when gemma3_1b did not compile (8,411 for 26 layers: 4.2× llama3_1b's per layer). Needs the gpu-compile extra (JAX's CUDA plugin): pip install -e '.[gpu-compile]'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("gemma3_1b", "llama3_1b", "qwen3_0_6b")
W4_SETTINGS = (
    "data=synthetic",
    "data.seq_len=4096",
    "training.mixed_precision=bf16",
    'model.mesh_shape=[[1,1],["fsdp","tp"]]',
)
GIB = 1024**3


def dry_run(model: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One model's dry run for the target in a child process: compile.json and plan.json."""
    run_dir = work / model
    command = [
        sys.executable,
        str(ROOT / "run_training.py"),
        f"model={model}",
        *W4_SETTINGS,
        f"training.micro_batch_size={args.micro_batch}",
        "training.dry_run=true",
        f"plan.target={args.target}",
        f"hydra.run.dir={run_dir}",
        *args.overrides,
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [
            line
            for line in (done.stderr or done.stdout).strip().splitlines()
            if line.strip() and not line.startswith(("For simplicity", "-----"))
        ]
        return {"model": model, "error": lines[-1] if lines else f"exit {done.returncode}"}
    compiled = json.loads((run_dir / "compile.json").read_text())
    plan = json.loads((run_dir / "plan.json").read_text())
    return {"model": model, **compiled, "plan": plan}


def _per_layer(result: dict[str, Any], measure: str) -> float:
    """The step's compile `seconds` or `fusions` per layer: unscanned, a step grows with depth
    (gemma3_1b has 26 layers, llama3_1b 16), so models are compared per layer."""
    return result["step"][measure] / result["num_layers"]


def problems(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """What broke a budget, one line each."""
    found = []
    llama = next((r for r in results if r["model"] == "llama3_1b" and "error" not in r), None)
    for result in results:
        model = result["model"]
        if "error" in result:
            found.append(f"{model}: the dry run failed: {result['error']}")
            continue
        init, step, plan = result["init"]["seconds"], result["step"]["seconds"], result["plan"]
        if init > args.budget_init:
            found.append(f"{model}: initialisation compiled in {init:.1f} s > {args.budget_init} s")
        if step > args.budget_step:
            found.append(f"{model}: train step compiled in {step:.1f} s > {args.budget_step} s")
        if llama is not None:
            fusions, llama_fusions = _per_layer(result, "fusions"), _per_layer(llama, "fusions")
            if fusions > args.fusion_ratio * llama_fusions:
                found.append(
                    f"{model}: train step of {fusions:.0f} fusions per layer > "
                    f"{args.fusion_ratio} × llama3_1b's {llama_fusions:.0f}"
                )
        if plan["fits"] is not True:
            found.append(
                f"{model}: XLA's plan {plan['total_bytes'] / GIB:.1f} GiB does not fit "
                f"{plan['device']}'s usable {plan['capacity_bytes'] / GIB:.1f} GiB"
            )
    return found


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = [
        f"compiled for {args.target} on this host's CPU (no autotuning), W4 settings, "
        f"micro-batch {args.micro_batch}:",
        "| model | layers | init | step | step per layer | step fusions | attention | cuDNN calls "
        "| XLA's plan |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error']} |||||")
            continue
        plan = (
            f"{r['plan']['total_bytes'] / GIB:.1f} GiB of {r['plan']['capacity_bytes'] / GIB:.1f}"
        )
        lines.append(
            f"| {r['model']} | {r['num_layers']} | {r['init']['seconds']:.1f} s | "
            f"{r['step']['seconds']:.1f} s | {_per_layer(r, 'seconds'):.2f} s | {r['step']['fusions']:,} | "
            f"{r['attention']} | {r['step']['cudnn_attention_calls']} | {plan} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="h100", help="plan.target: h100, h200 or b200")
    parser.add_argument("--model", nargs="+", default=list(MODELS), help="configs/model names")
    parser.add_argument("--micro-batch", type=int, default=8, help="training.micro_batch_size")
    parser.add_argument("--budget-init", type=float, default=30.0, help="seconds, per model")
    parser.add_argument("--budget-step", type=float, default=90.0, help="seconds, per model")
    parser.add_argument(
        "--fusion-ratio",
        type=float,
        default=2.0,
        help="largest step fusions per layer / llama3_1b's",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshtrain-compile-for-") as work:
        results = []
        for model in args.model:
            print(f"compiling {model} for {args.target}...", file=sys.stderr, flush=True)
            results.append(dry_run(model, args, Path(work)))
    print("\n".join(table(results, args)))
    if args.json:
        print(json.dumps(results, indent=2))
    found = problems(results, args)
    for line in found:
        print(f"FAILED {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
