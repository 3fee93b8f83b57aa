"""CI's closing table (.ci/report.py): the phases, the slowest tests, and the tests that compiled
longest from tests/helpers/compiles.py's lines."""

from __future__ import annotations

import importlib.util

from helpers.paths import REPO

spec = importlib.util.spec_from_file_location("ci_report", REPO / ".ci" / "report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def test_the_table_holds_the_phases_the_slowest_tests_and_the_longest_compiles(tmp_path):
    phases, durations, compiles = (tmp_path / name for name in ("p", "d", "c"))
    phases.write_text("README\t120\nslow\t300\n")
    durations.write_text("3.5\ttests/a.py::one\n9.0\ttests/b.py::two\n")
    # compiles, compile s, traces, trace s, lowering s, node id (tests/helpers/compiles.py)
    compiles.write_text(
        "4\t2.50\t4\t0.30\t0.10\ttests/a.py::one\n1\t7.25\t1\t0.20\t0.05\ttests/b.py::two\n"
    )
    table = report.format_report(
        report.read_phases(phases),
        report.read_durations(durations),
        1,
        report.read_compiles(compiles),
    )
    assert table.splitlines() == [
        "",
        "CI time by phase:",
        "  README     120 s  (  2.0 min)",
        "  slow       300 s  (  5.0 min)",
        "  total      420 s  (  7.0 min)",
        "",
        "The 1 slowest of 2 tests:",
        "      9.0 s  tests/b.py::two",
        "",
        "XLA compiles in the tests' own processes: 5 programs, 10 s; the 1 tests that compiled "
        "longest:",
        "      7.2 s     1 programs  tests/b.py::two",
    ]
    assert report.read_compiles(tmp_path / "missing") == []
