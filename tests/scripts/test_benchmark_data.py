"""scripts/benchmark_data.py: one quick run reports numbers consistent with the corpus, the
prepared directories and the W1 run it leaves in --work-dir (docs/data.md records the numbers
of a full run)."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import REPO

RATES = (
    "tokenise_tokens_per_sec",
    "tokenise_input_mb_per_sec",
    "read_tokens_per_sec_per_process",
    "read_sequences_per_sec_per_process",
    "read_step_s_per_process",
)
# A measurement (15 s for the quick run): `pytest -m bench`.
pytestmark = pytest.mark.bench


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, Path]:
    """The JSON of `benchmark_data.py --quick --json` and its work directory."""
    work = tmp_path_factory.mktemp("benchmark-data") / "work"
    command = [sys.executable, str(REPO / "scripts" / "benchmark_data.py")]
    args = ["--quick", "--json", "--work-dir", str(work)]
    proc = subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.strip().splitlines()
    return json.loads(line), work


def test_rates_are_positive_for_both_settings(quick):
    result, _ = quick
    for key in RATES:
        assert set(result[key]) == {"1", "2"}, key
        assert all(isinstance(v, float) and v > 0 for v in result[key].values()), key
    for key in ("w1_data_wait_s", "w1_step_time_s", "w1_data_wait_fraction"):
        assert isinstance(result[key], float) and result[key] >= 0, key
    assert result["w1_step_time_s"] > 0


def test_tokens_match_the_corpus_and_the_prepared_directories(quick):
    result, work = quick
    corpus = work / "corpus" / "corpus.jsonl"
    assert result["corpus_bytes"] == corpus.stat().st_size
    assert result["corpus_mb"] == pytest.approx(result["corpus_bytes"] / 1e6)
    assert 2.0 <= result["corpus_mb"] < 2.1  # --quick: 2 MB
    assert result["documents"] == len(corpus.read_text().splitlines())
    for name in ("prepared", "prepared-cli"):  # in-process workers=1, CLI --workers 2
        manifest = json.loads((work / name / "manifest.json").read_text())
        assert manifest["tokens"] == result["tokens"] > 0, name
        assert manifest["documents"] == result["documents"], name
    assert result["tokens_cli"] == result["tokens"]
    assert result["bpe_vocab_size"] == 1024
    for workers in ("1", "2"):
        seconds = result["tokenise_seconds"][workers]
        rate = result["tokenise_tokens_per_sec"][workers]
        assert rate == pytest.approx(result["tokens"] / seconds)
        mb_rate = result["tokenise_input_mb_per_sec"][workers]
        assert mb_rate == pytest.approx(result["corpus_mb"] / seconds)


def test_two_processes_read_half_the_rows_each(quick):
    result, _ = quick
    rows = result["read_rows_per_process"]
    assert rows == {"1": result["read_global_batch"], "2": result["read_global_batch"] // 2}
    assert result["read_seq_len"] == 256 and result["read_train_sequences"] > 0
    for p in ("1", "2"):
        tokens = result["read_tokens_per_sec_per_process"][p]
        sequences = result["read_sequences_per_sec_per_process"][p]
        assert tokens == pytest.approx(sequences * 256)
    assert result["read_sequences_per_sec_per_process"]["1"] == pytest.approx(
        rows["1"] / result["read_step_s_per_process"]["1"]
    )


def test_w1_feed_is_the_runs_metrics(quick):
    result, work = quick
    lines = (work / "w1-run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, 7))  # --quick: 6 steps, all logged
    steady = records[1:-1]  # not step 1 (it compiles), not the last (it reads nothing ahead)
    assert result["w1_steps"] == 6 and result["w1_steps_measured"] == len(steady) == 4
    assert result["w1_data_wait_s"] == statistics.median(r["data_wait_s"] for r in steady)
    assert result["w1_step_time_s"] == statistics.median(r["step_time_s"] for r in steady)
    fraction = result["w1_data_wait_s"] / result["w1_step_time_s"]
    assert result["w1_data_wait_fraction"] == pytest.approx(fraction)
    assert result["w1_target_fraction"] == 0.05
    assert result["w1_within_target"] == (fraction < 0.05)
    log = (work / "w1-run" / "train.log").read_text()
    assert "(prepared; document masking on)" in log  # trained on the prepared shards


def test_stamps(quick):
    result, work = quick
    assert result["command"] == f"python scripts/benchmark_data.py --quick --json --work-dir {work}"
    for key in ("machine", "date"):
        assert result[key]
    assert result["seconds"] > 0
