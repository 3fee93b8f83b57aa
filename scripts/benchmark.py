"""meshtrain's throughput benchmarks, W1 to W5 (docs/performance.md).

    python scripts/benchmark.py [--workload W1|W2|W3|W4|W5 ...] [--json] [--quick] [--reference]

W1  Llama-style, untied embeddings, d_model 256, 2 layers, 4 heads of 64 (4 kv heads), MLP 1024,
    vocabulary 32000, sequence 256, batch 4, 1 CPU device, fp32.
W2  W1 on 8 faked CPU devices, mesh [[4,2],["fsdp","tp"]], global batch 4.
W3  the default `python run_training.py`, from launch to the end of step 1: cold (empty caches)
    and warm (the same cache directory, second launch).
W4  llama3_1b and gemma3_1b in bf16 at sequence 4096 on one GPU, at the micro-batch that fits
    best (GPU only).
W5  W1's shapes as a mixture of experts (qwen3_moe: 16 experts of width 256, 4 per token, W1's
    MLP width in active parameters) on 8 faked CPU devices, mesh [[2,4],["ep","fsdp"]], global
    batch 8; then W5-dense, the same model with a dense MLP of 1024 on [[8,1],["fsdp","tp"]],
    and the ratio of their step times (dense / MoE: 1 is the MoE at the dense model's speed).

Each of W1, W2 and W4 runs in a child process of its own (the device count is fixed when JAX
starts), builds the step as a run does (the config composed by Hydra from configs/, then
meshtrain.train.setup.prepare, train.compilation.compile_train_step and a fresh train state, batches from the
data pipeline), measures the device's matmul peak in the same run
(meshtrain.observe.throughput.matmul_peak) and times single steps: the median step time,
tokens/s, TFLOP/s per device and MFU (meshtrain.observe.flops.train_flops_per_step over the
measured peak), the compile time and the peak memory. JAX's persistent compilation cache is off
in those children, so the compile time is a real compile.

--reference (W1) also times a plain hand-written Flax NNX + optax loop of the same dimensions,
interleaved step by step with meshtrain's in the same process, and prints the ratio.
--json prints one JSON object per workload on stdout (progress goes to stderr); --save FILE
also writes them as one document (docs/benchmarks.json is one; compare a new run with
scripts/compare_benchmarks.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from bench.common import (
    DEVICES,
    OVERRIDES,
    REPO,
    W4_MODELS,
    WORKLOADS,
    child_env,
    progress,
    stamp,
    steps_of,
)
from bench.measure import measure

# The tests read the W3 parsing here.
from bench.w3 import _STEP1, _flops, _metrics_of, run_w3, w3_env  # noqa: F401
from bench.w4 import run_w4

__all__ = ["OVERRIDES", "child_env", "main", "progress", "stamp"]


def run_child(workload: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs `workload` in a child process of its own (this script with --child) and returns
    its results."""
    with tempfile.TemporaryDirectory(prefix="meshtrain-benchmark-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", workload, "--child-out", str(out)]
        command += ["--quick"] if args.quick else []
        command += ["--reference"] if args.reference else []
        command += [f"--steps={args.steps}"] if args.steps else []
        command += [f"--warmup={args.warmup}"] if args.warmup is not None else []
        command += [f"--micro-batch={args.micro_batch}"] if args.micro_batch else []
        command += [f"--model={name}" for name in args.model]
        command += [f"--override={o}" for o in args.override]
        proc = subprocess.run(command, env=child_env(workload), cwd=REPO)
        if proc.returncode != 0 or not out.is_file():
            raise SystemExit(f"benchmark: {workload} failed (exit code {proc.returncode})")
        return json.loads(out.read_text())


def child_main(args: argparse.Namespace) -> None:
    """In the child: measure one workload, write its results (a list) to --child-out."""
    import logging

    from meshtrain.cli.train import configure_xla_gpu_flags

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # As `python run_training.py` does before JAX starts: on GPU, meshtrain's XLA flags.
    configure_xla_gpu_flags("training.xla_gpu_flags=false" not in args.override)
    import jax

    workload = args.child
    devices = jax.devices()
    if workload == "W4":
        if devices[0].platform != "gpu":
            results = [
                {"workload": "W4", "skipped": f"W4 needs a GPU; found {devices[0].platform}"}
            ]
        else:
            results = run_w4(args, devices)
    else:
        if len(devices) < DEVICES[workload]:
            raise SystemExit(f"{workload} needs {DEVICES[workload]} devices, found {len(devices)}")
        warmup, timed = steps_of(workload, args)
        overrides = [*OVERRIDES[workload], *args.override]
        reference = args.reference and workload == "W1"
        used = devices[: DEVICES[workload]]
        results = [measure(workload, overrides, used, (warmup, timed), reference)]
        if workload == "W5":  # and the dense model of as many active parameters, after it
            dense = measure(
                "W5-dense",
                [*OVERRIDES["W5-dense"], *dense_overrides(args.override)],
                used,
                (warmup, timed),
                False,
            )
            results[0]["dense_ratio"] = dense["step_time_s"] / results[0]["step_time_s"]
            results.append(dense)
    Path(args.child_out).write_text(json.dumps(results))


def dense_overrides(overrides: list[str]) -> list[str]:
    """The overrides W5-dense takes: all but the mixture of experts' (model.moe.*), which a
    dense model refuses."""
    return [o for o in overrides if not o.lstrip("+~").startswith("model.moe.")]


def describe(result: dict[str, Any]) -> list[str]:
    """The lines a result prints without --json."""
    w = result["workload"]
    if "skipped" in result:
        return [f"{w}: {result['skipped']}"]
    if w == "W3":
        lines = [
            f"W3 `{result['launched']}`, launch to the end of step 1:",
            f"  cold {result['cold_s']:.1f} s (empty caches; milestones {result['cold_milestones_s']})",
            f"  warm {result['warm_s']:.1f} s (second launch; milestones {result['warm_milestones_s']})",
        ]
        return lines
    lines = [
        f"{w} {result['model']}: {result['devices']} {result['device_kind']} device(s), mesh "
        f"{result['mesh']}, batch {result['global_batch']} × {result['seq_len']}, "
        f"{result['mixed_precision']}",
        f"  step time    {result['step_time_s']:.4f} s (median of {result['steps_timed']}; "
        f"min {result['step_time_min_s']:.4f}, max {result['step_time_max_s']:.4f})",
        f"  tokens/s     {result['tokens_per_sec']:,.0f}",
        f"  TFLOP/s/dev  {result['tflops_per_device']:.4g}",
        f"  MFU          {result['mfu']:.1%} of {result['peak_tflops'] * 1e3:.1f} GFLOP/s per "
        f"device ({result['peak_source']}); {result['mfu_best_known_peak']:.1%} of the best "
        f"known here, {result['best_known_peak_tflops'] * 1e3:.1f} GFLOP/s",
    ]
    if "mfu_spec" in result:
        lines.append(
            f"  MFU (spec)   {result['mfu_spec']:.1%} of {result['spec_peak_tflops']:.0f} TFLOP/s"
        )
    lines += [
        f"  compile      {result['compile_s']:.1f} s",
        f"  peak memory  {result['peak_memory_gib']:.2f} GiB ({result['peak_memory_source']}); "
        f"the compiled step plans {result['planned_step_memory_gib']:.3f} GiB",
    ]
    if "dense_ratio" in result:
        lines.append(
            f"  dense / MoE  {result['dense_ratio']:.2f}× (W5-dense's step time over W5's)"
        )
    if "reference" in result:
        ref = result["reference"]
        lines.append(
            f"  reference    {ref['tokens_per_sec']:,.0f} tokens/s ({ref['step_time_s']:.4f} s/step, "
            f"MFU {ref['mfu']:.1%}); meshtrain / reference = {result['reference_ratio']:.2f}×"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    """Parses the command line; runs each workload (or, with --child, one in this process)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", action="append", choices=WORKLOADS, help="default: W1")
    parser.add_argument("--json", action="store_true", help="one JSON object per workload")
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke test)")
    parser.add_argument("--reference", action="store_true", help="W1: also the hand-written loop")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (W1, W2, W4)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument("--micro-batch", type=int, default=None, help="W4: skip the search")
    parser.add_argument(
        "--model", action="append", default=[], choices=W4_MODELS, help="W4: default both"
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="extra Hydra override of every workload (model.moe.* ones: of W5's MoE only, not of "
        "W5-dense, e.g. --override model.moe.capacity_factor=1.25)",
    )
    parser.add_argument("--save", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args)
        return
    results = []
    for workload in dict.fromkeys(args.workload or ["W1"]):
        found = [run_w3(args.override)] if workload == "W3" else run_child(workload, args)
        for result in found:
            result = stamp(result, argv)
            results.append(result)
            if args.json:
                print(json.dumps(result), flush=True)
            else:
                print("\n".join(describe(result)), flush=True)
    if args.save:
        document = {"results": results}
        args.save.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
