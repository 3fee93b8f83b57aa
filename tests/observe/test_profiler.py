"""The profiler window and the measured communication, from the command line."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from helpers.commands import train_command
from helpers.config import compose_config

from meshtrain.config.validate import check_config
from meshtrain.errors import ConfigError
from meshtrain.observe.profiler import ProfilerWindow
from meshtrain.observe.trace import collective_time, find_trace, step_annotations


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    """5 steps on 8 devices (fsdp); the window asks for steps 4-6 and is cut at the last step."""
    run_dir = tmp_path_factory.mktemp("profiled")
    result = train_command(
        'model.mesh_shape=[[8,1],["fsdp","tp"]]',
        "training.micro_batch_size=1",
        "data=synthetic",
        "training.steps=5",
        "training.warmup_steps=1",
        "training.log_every=1",
        "training.eval_every=0",
        "training.profile=true",
        "profile.start_step=4",
        "profile.num_steps=3",
        "training.profile_communication=true",
        f"hydra.run.dir={run_dir}",
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


@pytest.mark.slow
def test_trace_holds_the_annotated_window(profiled_run):
    run_dir, _ = profiled_run
    trace = find_trace(run_dir / "profile")
    assert trace is not None and trace.name.endswith(".xplane.pb")
    # Steps 4 and 5: the window stops at the last training step.
    assert step_annotations(trace) == [4, 5]


@pytest.mark.slow
def test_measured_collective_share(profiled_run):
    run_dir, result = profiled_run
    report = json.loads((run_dir / "communication.json").read_text())
    measured = report["measured"]
    assert measured["devices"] == 8 and measured["steps"] == 2
    assert 0 < measured["collective_share"] < 1
    assert 0 <= measured["overlapped_share"] <= 1
    assert measured["exposed_collective_share"] <= measured["collective_share"]
    # Every kind the compiled step holds was seen running.
    assert set(measured["by_kind_s_per_step"]) == {r["kind"] for r in report["summary"]}
    # The trace's operations are the compiled step's, by name.
    trace = find_trace(run_dir / "profile")
    again = collective_time(trace, module=report["module"], num_steps=2)
    assert again["collective_s_per_step"] == pytest.approx(measured["collective_s_per_step"])
    log = (run_dir / "train.log").read_text()
    assert "profiler: collectives took" in log and "overlapped compute" in log
    assert "communication per device per step, from the compiled HLO" in result.stdout


@pytest.mark.slow  # the profiled run (14 s) its siblings read in the slow set
def test_throughput_metrics_are_consistent(profiled_run):
    run_dir, _ = profiled_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert r["tokens_per_sec_per_device"] == pytest.approx(r["tokens_per_sec"] / 8)
        # plan.json holds the model FLOPs per device per step.
        assert r["tflops_per_device"] == pytest.approx(
            plan["flops_per_step"] / r["step_time_s"] / 1e12
        )
        assert 0 < r["mfu"] < 1  # against the matmul peak measured at start-up
        assert 0 <= r["data_wait_s"] < r["step_time_s"]
        assert "memory_in_use_gib" not in r  # the CPU backend reports no memory
    ratios = {r["mfu"] / r["tflops_per_device"] for r in records}
    assert max(ratios) == pytest.approx(min(ratios))  # one peak for the whole run


def test_window_after_the_last_step_is_an_error():
    cfg = compose_config("training.profile=true", "training.steps=5", "profile.start_step=9")
    with pytest.raises(
        ConfigError, match=r"profile.start_step=9 comes after the last step \(training.steps=5\)"
    ):
        check_config(cfg)


def test_other_processes_trace_only_with_all_ranks(monkeypatch, tmp_path):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    cfg = compose_config("training.profile=true").profile
    assert not ProfilerWindow(cfg, tmp_path, enabled=True, last_step=10).active
    everyone = dataclasses.replace(cfg, all_ranks=True)
    window = ProfilerWindow(everyone, tmp_path, enabled=True, last_step=10)
    assert window.active and window.directory == tmp_path / "profile" / "process_1"
    assert not ProfilerWindow(everyone, tmp_path, enabled=False, last_step=10).active


def test_a_run_that_stops_inside_the_window_still_writes_its_trace(tmp_path):
    cfg = compose_config("profile.start_step=1", "profile.num_steps=5").profile
    state = jnp.ones((4,))
    with ProfilerWindow(cfg, tmp_path, enabled=True, last_step=10) as window:
        window.before_step(1, state)
        window.after_step(1, state + 1)  # then the run ends, e.g. with an exception
    trace = find_trace(tmp_path / "profile")
    assert trace is not None and step_annotations(trace) == [1]
