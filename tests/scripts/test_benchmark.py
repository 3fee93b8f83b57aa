"""scripts/benchmark.py and scripts/compare_benchmarks.py: W1 runs (one quick step) and reports
sane numbers as JSON, W4 says it needs a GPU, the log parsing of W3, the comparison's ratios."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import REPO

SCRIPTS = REPO / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MESHTRAIN_CACHE_DIR": str(cache)}  # the measured peak goes there
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "benchmark.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.bench  # .ci/run runs the same quick benchmark itself
def test_w1_quick_json(tmp_path):
    proc = benchmark(
        "--workload", "W1", "--quick", "--warmup", "0", "--steps", "1", "--json", cache=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.strip().splitlines()
    result = json.loads(line)
    for key in ("tokens_per_sec", "step_time_s", "tflops_per_device", "mfu", "peak_tflops"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["compile_s"] > 0 and result["peak_memory_gib"] > 0
    assert result["peak_memory_source"] == "process peak RSS"  # the CPU reports no memory
    assert result["workload"] == "W1" and result["devices"] == 1
    assert (result["global_batch"], result["seq_len"]) == (4, 256)
    assert result["tokens_per_sec"] == pytest.approx(4 * 256 / result["step_time_s"])
    tflops = result["flops_per_step"] / result["step_time_s"] / 1e12
    assert result["tflops_per_device"] == pytest.approx(tflops)
    assert result["mfu"] == pytest.approx(result["tflops_per_device"] / result["peak_tflops"])
    # The peak is this machine's best matmul, measured in the same run: W1 logs about 55% on a
    # quiet machine, and no model can beat the best matmul.
    assert 0.0 < result["mfu"] < 1.0
    for key in ("machine", "date", "command"):
        assert result[key]
    assert "scripts/benchmark.py --workload W1" in result["command"]
    assert (tmp_path / "peak.json").is_file()  # the run's measurement is cached


def test_w4_needs_a_gpu(tmp_path):
    proc = benchmark("--workload", "W4", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "W4 needs a GPU" in proc.stdout


def test_w5_dense_takes_every_override_but_the_mixture_of_experts():
    bench = load("benchmark")
    overrides = ["model.moe.capacity_factor=1.25", "+model.moe.x=1", "training.steps=3"]
    assert bench.dense_overrides(overrides) == ["training.steps=3"]


def test_w3_reads_the_step_1_line():
    bench = load("benchmark")
    line = (
        "20:32:12 INFO meshtrain.observe.metrics: step 1/200 loss=5.8743 lr=1.50e-04 "
        "grad_norm=5.50 step_time=0.520s tokens/s=1,970 tokens/s/device=1,970 "
        "TFLOP/s/device=0.00833 mfu=9.9% data_wait=0.0014s eta=1m43s"
    )
    assert bench._STEP1.search(line)
    assert bench._metrics_of(line) == {
        "step_time_s": 0.52,
        "tokens_per_sec": 1970.0,
        "tflops_per_device": 0.00833,
        "mfu": pytest.approx(0.099),
    }
    peak = "MFU against 84.45 GFLOP/s per device (best fp32 matmul ...)"
    assert bench._flops(r"MFU against ([\d.]+ [KMGTP]?FLOP)/s", peak) == pytest.approx(0.08445)


def test_the_w3_launch_gets_fresh_caches_and_one_device(tmp_path, monkeypatch):
    bench = load("benchmark")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_dump_to=/x")
    env = bench.w3_env(tmp_path)
    assert "JAX_COMPILATION_CACHE_DIR" not in env
    assert env["MESHTRAIN_CACHE_DIR"] == str(tmp_path)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/x"
    w2_flags = bench.child_env("W2")["XLA_FLAGS"].split()
    assert [f for f in w2_flags if "device_count" in f] == [
        "--xla_force_host_platform_device_count=8"
    ]
    assert "--xla_dump_to=/x" in w2_flags
    assert "--xla_cpu_collective_timeout_seconds=86400" in w2_flags
    assert bench.child_env("W1")["JAX_ENABLE_COMPILATION_CACHE"] == "false"


def test_compare_prints_the_ratio_per_workload_and_metric(tmp_path, capsys):
    compare = load("compare_benchmarks")
    baseline = tmp_path / "baseline.json"
    baseline.write_text(
        json.dumps(
            {
                "results": [
                    {"workload": "W1", "tokens_per_sec": 1000.0, "step_time_s": 1.0, "mfu": 0.3},
                    {"workload": "W3", "cold_s": 20.0, "warm_s": 5.0},
                ]
            }
        )
    )
    new = tmp_path / "new.json"  # the JSON lines of --json
    new.write_text(
        json.dumps({"workload": "W1", "tokens_per_sec": 1500.0, "step_time_s": 0.5, "mfu": 0.3})
        + "\n"
        + json.dumps({"workload": "W3", "cold_s": 10.0, "warm_s": 10.0})
        + "\n"
    )
    assert compare.main([str(new), "--baseline", str(baseline)]) == 0
    out = capsys.readouterr().out
    assert "W1" in out and "tokens_per_sec" in out and "1.500×" in out and "better" in out
    assert "0.500×" in out  # step time halved
    warm = next(line for line in out.splitlines() if "warm_s" in line)
    assert "2.000×" in warm and "worse" in warm
    assert compare.main([str(new), "--baseline", str(baseline), "--fail-below", "0.9"]) == 1
    assert compare.main([str(new), "--baseline", str(baseline), "--fail-below", "0.4"]) == 0


def test_the_committed_baseline_loads():
    compare = load("compare_benchmarks")
    results = compare.load_results(REPO / "docs" / "benchmarks.json")
    assert {"W1", "W2", "W3"} <= set(results)
    for name in ("W1", "W2"):
        assert results[name]["tokens_per_sec"] > 0 and results[name]["machine"]
