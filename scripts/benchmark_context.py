"""Context parallelism at long sequences (docs/parallelism.md#context-parallelism-cp).

    python scripts/benchmark_context.py [--lengths 16384 32768] [--cp 1 2 4 8] [--steps 1]
        [--plan-only 65536] [--json OUT]
    python scripts/benchmark_context.py --plan [--json OUT]

Without --plan: the tiny model (fp32, remat=full) on one sequence of each length, on 8 faked
CPU devices split between cp and tp (model.mesh_shape=[[cp, 8/cp],[cp,tp]]: the same global
batch, the same devices, only the split differs), each in a child process of its own. For each:
the planned memory per device (XLA's memory analysis of the compiled step, plan.json's total),
the process's peak RSS over the 8 devices (the CPU backend reports no device peak), and the
median step time after a warm-up step. A cell whose 8 devices' plan exceeds 70% of the
machine's memory is compiled and planned, not run; so are the lengths given to --plan-only.

--plan: the planner's answer (training.dry_run, compiled for H100s with plan.target, checked
against the H100's 80 GB) for llama3_8b at sequence 131072, micro-batch 1, bf16, remat=full,
scanned layers, on 8 GPUs ([[8,1],[fsdp,cp]] without cp, [[1,8],[fsdp,cp]] with cp=8) and on 16
([[2,8],[fsdp,cp]]).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

DEVICES = 8  # as child_env("W2") fakes them
FITS = 0.7  # a cell runs when 8 × its planned memory per device fits in this share of the RAM
PLANS = {  # GPUs → mesh_shape of llama3_8b at 128k
    "8 GPUs, fsdp=8 (no cp)": "[[8,1],[fsdp,cp]]",
    "8 GPUs, cp=8": "[[1,8],[fsdp,cp]]",
    "16 GPUs, fsdp=2 × cp=8": "[[2,8],[fsdp,cp]]",
}


def child(length: int, cp: int, steps: int, run: bool) -> dict:
    """In the child: compile, then (if `run`) warm up and time; the numbers of one cell."""
    import jax
    from bench.measure import MeshtrainStep

    overrides = [
        "data=synthetic",
        f"data.seq_len={length}",
        "model.max_seq_len=" + str(length),
        f"model.mesh_shape=[[{cp},{DEVICES // cp}],[cp,tp]]",
        "model.remat=full",
        "training.micro_batch_size=1",
        "training.mixed_precision=fp32",
    ]
    step = MeshtrainStep(compose(overrides), jax.devices()[:DEVICES])
    result = {
        "seq_len": length,
        "cp": cp,
        "tp": DEVICES // cp,
        "planned_gib_per_device": step.planned_memory_gib(),
        "compile_s": step.compile_s,
    }
    machine_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if step.planned_memory_gib() * DEVICES > FITS * machine_gib:
        return {
            **result,
            "run": f"not run: 8 devices × the plan > {FITS:.0%} of {machine_gib:.0f} GiB",
        }
    if not run:
        return {**result, "run": "planned only"}
    step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        **result,
        "run": "measured",
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "step_time_s": statistics.median(times),
        "tokens_per_s": length / statistics.median(times),
        "steps_timed": len(times),
    }


def run_child(length: int, cp: int, steps: int, run: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", str(length), str(cp), str(out)]
        command += ["--steps", str(steps)] + ([] if run else ["--compile-only"])
        # W2's: 8 faked CPU devices, their collective timeouts raised, no compilation cache.
        subprocess.run(command, env=child_env("W2"), cwd=REPO, check=True)
        return json.loads(out.read_text())


def plan(name: str, mesh: str) -> dict:
    """The dry run's verdict for llama3_8b at 128k on `mesh` of H100s."""
    saved, _ = dry_run_plan(
        [*LLAMA3_8B_ON_H100, "data.seq_len=131072", f"model.mesh_shape={mesh}", "plan.device=h100"]
    )
    return {
        "model": "llama3_8b",
        "seq_len": 131072,
        "setup": name,
        "mesh_shape": mesh,
        "total_gib": saved["total_bytes"] / 2**30,
        "activation_gib": saved["activation_bytes"] / 2**30,
        "fits": saved["fits"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="*", type=int, default=[16384, 32768])
    parser.add_argument("--plan-only", nargs="*", type=int, default=[65536])
    parser.add_argument("--cp", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        length, cp, out = args.child
        result = child(int(length), int(cp), args.steps, run=not args.compile_only)
        Path(out).write_text(json.dumps(result))
        return
    results, load_before = [], os.getloadavg()[0]
    if args.plan:
        for name, mesh in PLANS.items():
            progress(f"planning llama3_8b at 128k: {name}")
            results.append(plan(name, mesh))
    else:
        cells = [(n, True) for n in args.lengths] + [(n, False) for n in args.plan_only]
        for length, run in cells:
            for cp in args.cp:
                progress(f"seq_len {length}, cp={cp}{'' if run else ' (planned only)'}")
                results.append(run_child(length, cp, args.steps, run))
                print(json.dumps(results[-1]), flush=True)
    for result in results:
        print(json.dumps(result))
    if args.json:
        write_results(args.json, results, load_before)


if __name__ == "__main__":
    main()
