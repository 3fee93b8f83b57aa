"""Compares a run of scripts/benchmark.py with the committed numbers: the ratio new / baseline of
every metric, per workload.

    python scripts/benchmark.py --workload W1 --workload W2 --json > new.json
    python scripts/compare_benchmarks.py new.json [--baseline docs/benchmarks.json]

Both files may hold the JSON lines `--json` prints, a list of results, or a document
{"results": [...]} as `--save` writes it (docs/benchmarks.json is one). A ratio above 1 is
better for throughput metrics (tokens/s, TFLOP/s, MFU, the reference ratio) and worse for times;
the last column says which. Numbers from different machines compare the machines as much as the
code: the machines are printed. Nothing fails unless --fail-below is given: then any metric
worse than that ratio (e.g. 0.8: 20% slower) makes the exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = REPO / "docs" / "benchmarks.json"

# metric → True when higher is better.
METRICS: dict[str, bool] = {
    "tokens_per_sec": True,
    "step_time_s": False,
    "tflops_per_device": True,
    "mfu": True,
    "peak_tflops": True,
    "compile_s": False,
    "reference_ratio": True,
    "cold_s": False,
    "warm_s": False,
}


def load_results(path: Path) -> dict[str, dict[str, Any]]:
    """Results by name (the workload, with the model where a workload has several)."""
    text = path.read_text().strip()
    try:
        data = json.loads(text)
        items = data.get("results", []) if isinstance(data, dict) else data
    except json.JSONDecodeError:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    results = {}
    for item in items:
        if "skipped" in item:
            continue
        name = item["workload"]
        if item.get("workload") == "W4":
            name = f"W4 {item.get('model', '?')}"
        results[name] = item
    return results


def compare(
    new: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> tuple[list[str], list[tuple[str, str, float]]]:
    """The table's lines, and (workload, metric, ratio oriented so that < 1 is worse) per cell."""
    lines = [f"{'workload':<14} {'metric':<18} {'baseline':>12} {'new':>12} {'new/base':>9}"]
    cells = []
    for name in sorted(new):
        if name not in baseline:
            lines.append(f"{name:<14} (not in the baseline)")
            continue
        for metric, higher_is_better in METRICS.items():
            old, value = baseline[name].get(metric), new[name].get(metric)
            if not isinstance(old, int | float) or not isinstance(value, int | float) or not old:
                continue
            ratio = value / old
            better = ratio if higher_is_better else (1 / ratio if ratio else float("inf"))
            verdict = "better" if better > 1 else "worse" if better < 1 else "same"
            lines.append(
                f"{name:<14} {metric:<18} {old:>12.4g} {value:>12.4g} {ratio:>8.3f}×  "
                f"{verdict} ({'higher' if higher_is_better else 'lower'} is better)"
            )
            cells.append((name, metric, better))
    for name in sorted(set(baseline) - set(new)):
        lines.append(f"{name:<14} (not in the new run)")
    return lines, cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("new", type=Path, help="results of scripts/benchmark.py --json")
    parser.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE)
    parser.add_argument(
        "--fail-below",
        type=float,
        default=None,
        help="exit 1 if a metric is worse than this ratio (e.g. 0.8)",
    )
    args = parser.parse_args(argv)
    new, baseline = load_results(args.new), load_results(args.baseline)
    machines = {r.get("machine") for r in baseline.values()} | {
        r.get("machine") for r in new.values()
    }
    print(f"baseline: {args.baseline}")
    for machine in sorted(m for m in machines if m):
        print(f"machine: {machine}")
    lines, cells = compare(new, baseline)
    print("\n".join(lines))
    if args.fail_below is not None:
        worse = [(n, m, r) for n, m, r in cells if r < args.fail_below]
        for name, metric, ratio in worse:
            print(f"regression: {name} {metric} at {ratio:.3f}× of the baseline", file=sys.stderr)
        return 1 if worse else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
