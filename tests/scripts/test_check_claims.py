"""scripts/checks/check_claims.py, without timing anything: every claim it measures is still stated in
its document, with the number it checks, and README.md states no time it does not measure."""

import importlib.util
import re
import sys

import pytest
from helpers.paths import REPO

spec = importlib.util.spec_from_file_location(
    "check_claims", REPO / "scripts/checks/check_claims.py"
)
check_claims = importlib.util.module_from_spec(spec)
sys.modules["check_claims"] = check_claims  # dataclasses look their module up there
spec.loader.exec_module(check_claims)

TIME = re.compile(r"\b\d+(?:\.\d+)?(?: to \d+(?:\.\d+)?)?\s?(?:s|min|minutes|seconds)\b")
SIZE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:GiB|GB)\b")


def _prose(text: str) -> str:
    """The text with code blocks blanked out (their lengths kept) and whitespace as spaces."""
    text = re.sub(r"```.*?```", lambda m: " " * len(m.group()), text, flags=re.DOTALL)
    return re.sub(r"\s", " ", text)


def _spans(doc: str) -> list[tuple[int, int]]:
    text = _prose((REPO / doc).read_text())
    spans = []
    for claim in check_claims.CLAIMS:
        if claim.doc == doc:
            words = " ".join(claim.words.split())
            start = text.find(words)
            spans.append((start, start + len(words)))
    return spans


@pytest.mark.parametrize("claim", check_claims.CLAIMS, ids=lambda c: c.words[:30])
def test_each_claim_is_stated_in_its_document_with_its_number(claim):
    text = " ".join((REPO / claim.doc).read_text().split())
    words = " ".join(claim.words.split())
    assert words in text, (
        f"{claim.doc} no longer says {words!r}: update scripts/checks/check_claims.py"
    )
    numbers = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", words)]
    ranges = [(float(a) + float(b)) / 2 for a, b in re.findall(r"(\d+) to (\d+)", words)]
    assert claim.claimed in numbers + ranges  # "12 to 15 minutes" is checked against 13.5
    assert claim.measure in check_claims.MEASURES
    assert claim.group in ("quick", "all", "suite")


@pytest.mark.parametrize("pattern", [TIME, SIZE], ids=["times", "sizes"])
def test_readme_states_no_number_the_script_does_not_measure(pattern):
    text = _prose((REPO / "README.md").read_text())
    spans = _spans("README.md")
    assert all(start >= 0 for start, _ in spans)
    unmeasured = [
        m.group()
        for m in pattern.finditer(text)
        if not any(start <= m.start() and m.end() <= end for start, end in spans)
    ]
    assert unmeasured == [], (
        "numbers in README.md without a claim in scripts/checks/check_claims.py"
    )


def test_a_claim_holds_within_a_factor_of_one_and_a_half():
    assert check_claims.holds(20, 29.9) and check_claims.holds(20, 13.4)
    assert not check_claims.holds(20, 30.1) and not check_claims.holds(20, 13.3)


def test_a_size_holds_to_the_digits_it_states():
    assert check_claims.holds(38.64, 38.6449, exact=True)
    assert not check_claims.holds(38.64, 38.65, exact=True)
    assert not check_claims.holds(38.64, 38.0, exact=True)  # within 1.5x, but not the same size


def test_a_stale_claim_fails_only_with_strict(monkeypatch, capsys):
    """What CI relies on: without --strict a stale claim is printed, and the exit code is 0."""
    stale = check_claims.Claim("README.md", "about 10 s", 10, "s", "fake")
    monkeypatch.setattr(check_claims, "CLAIMS", (stale,))
    monkeypatch.setattr(check_claims, "MEASURES", {"fake": lambda _: 16.0})
    assert check_claims.main([]) == 0
    assert capsys.readouterr().out == (
        "STALE  README.md: 'about 10 s': claimed 10 s, measured 16 s\n"
    )
    assert check_claims.main(["--strict"]) == 1
    monkeypatch.setattr(check_claims, "MEASURES", {"fake": lambda _: 14.0})
    assert check_claims.main(["--strict"]) == 0


def test_ci_runs_it_as_a_report_and_the_readme_says_so():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    calls = [line for line in ci if "check_claims.py" in line and not line.startswith("#")]
    # no --strict: machine noise fails nothing
    assert calls == ['phase "documented claims" python scripts/checks/check_claims.py']
    readme = " ".join((REPO / "README.md").read_text().split())
    assert (
        "`python scripts/checks/check_claims.py` without `--strict`: a report of the documented times "
        "measured again, next to the claims, which fails nothing"
    ) in readme


def test_the_suite_claim_is_the_readme_test_command():
    (wall,) = [claim for claim in check_claims.CLAIMS if claim.measure == "suite_min"]
    (cpu,) = [claim for claim in check_claims.CLAIMS if claim.measure == "suite_cpu_min"]
    assert (wall.doc, wall.claimed, wall.unit, wall.group) == ("README.md", 5, "min", "suite")
    assert (cpu.doc, cpu.claimed, cpu.unit, cpu.group) == ("README.md", 9, "cpu min", "suite")
    readme = " ".join((REPO / "README.md").read_text().split())
    assert (
        "`python -m pytest -q -n 2` runs the default suite on 8 faked CPU devices (set up in "
        "`tests/conftest.py`), on two pytest-xdist workers (a file's tests on one of them), "
        f"{' '.join(wall.words.split())} {' '.join(cpu.words.split())}" in readme
    )
