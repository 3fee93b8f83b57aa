"""The table `.ci/run` prints at its end: seconds per phase, the slowest tests, and the tests
that compile the most.

    python .ci/report.py PHASES DURATIONS [--compiles COMPILES] [--slowest N]

PHASES: one `name<TAB>seconds` line per phase, as .ci/run writes them. DURATIONS: one
`seconds<TAB>node id` line per test (set-up, call and teardown together), as tests/conftest.py
writes them when MESHTRAIN_TEST_DURATIONS names the file; every pytest session of the CI run
appends to it. COMPILES: tests/helpers/compiles.py's lines (MESHTRAIN_TEST_COMPILES): the
programs each test compiled in its own process and the seconds XLA took.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def read_phases(path: Path) -> list[tuple[str, int]]:
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    return [(name, int(seconds)) for name, seconds in rows]


def read_durations(path: Path) -> list[tuple[float, str]]:
    if not path.is_file():
        return []
    rows = [line.split("\t", 1) for line in path.read_text().splitlines() if line.strip()]
    return sorted(((float(seconds), node) for seconds, node in rows), reverse=True)


def read_compiles(path: Path | None) -> list[tuple[float, int, str]]:
    """(compile seconds, compiles, node id) of each test, most seconds first."""
    if path is None or not path.is_file():
        return []
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    return sorted(((float(r[1]), int(r[0]), r[5]) for r in rows), reverse=True)


def format_report(
    phases: list[tuple[str, int]],
    durations: list[tuple[float, str]],
    slowest: int,
    compiles: list[tuple[float, int, str]] = (),
) -> str:
    width = max([len(name) for name, _ in phases] + [len("total")])
    lines = ["", "CI time by phase:"]
    lines += [
        f"  {name:<{width}}  {seconds:>6d} s  ({seconds / 60:5.1f} min)" for name, seconds in phases
    ]
    total = sum(seconds for _, seconds in phases)
    lines.append(f"  {'total':<{width}}  {total:>6d} s  ({total / 60:5.1f} min)")
    if durations:
        lines += ["", f"The {min(slowest, len(durations))} slowest of {len(durations)} tests:"]
        lines += [f"  {seconds:7.1f} s  {node}" for seconds, node in durations[:slowest]]
    if compiles:
        total_s, total_n = sum(c[0] for c in compiles), sum(c[1] for c in compiles)
        lines += [
            "",
            f"XLA compiles in the tests' own processes: {total_n} programs, {total_s:.0f} s; "
            f"the {min(slowest, len(compiles))} tests that compiled longest:",
        ]
        lines += [f"  {s:7.1f} s  {n:4d} programs  {node}" for s, n, node in compiles[:slowest]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phases", type=Path)
    parser.add_argument("durations", type=Path)
    parser.add_argument("--compiles", type=Path)
    parser.add_argument("--slowest", type=int, default=15)
    args = parser.parse_args()
    durations = read_durations(args.durations)
    compiles = read_compiles(args.compiles)
    print(format_report(read_phases(args.phases), durations, args.slowest, compiles))


if __name__ == "__main__":
    main()
