"""The command line: one-line errors with exit code 2, --cfg job and --help (run_training.py's
main() in this process, helpers.commands), and the real `python run_training.py` once: a quoted
mesh, multirun, the live bar on a terminal."""

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.commands import train_command
from helpers.one_process import CONSTANT_RUN
from helpers.paths import REPO
from helpers.process import assert_one_line_error, run_training, subprocess_env


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "model.mesh_shape=[[3,1],[fsdp,tp]]",
            "model.mesh_shape [[3,1],[fsdp,tp]] uses 3 devices but 8 are visible; use [[8,1],[fsdp,tp]] or [[4,2],[fsdp,tp]]",
        ),
        (
            "model.mesh_shape=[[16,1],[fsdp,tp]]",
            "model.mesh_shape [[16,1],[fsdp,tp]] uses 16 devices but 8 are visible; use "
            "[[8,1],[fsdp,tp]] or [[4,2],[fsdp,tp]], or -1 for one size (e.g. [[-1,1],[fsdp,tp]]); "
            "on a CPU, fake 16 devices with XLA_FLAGS=--xla_force_host_platform_device_count=16 "
            "or plan.fake_devices=16",
        ),
        (
            'model.mesh_shape=[[4,2],["data","tp"]]',
            "unknown axis 'data'; known axes are dp, pp, fsdp, ep, cp, tp",
        ),
        ("model.mesh_shape=[[4,2,1],[fsdp,tp]]", "has 3 sizes but 2 axis names"),
        (
            "model.mesh_shape=[[8,1],[tp,fsdp]] model.num_heads=4 model.num_kv_heads=2",
            "tp=8 in model.mesh_shape does not divide model.num_heads=4; model tiny has 4 query "
            "heads and 2 key/value head(s); use tp in {1, 2, 4}",
        ),
        (
            "model.mesh_shape=[[8,1],[fsdp,tp]] training.global_batch_size=12",
            "training.global_batch_size=12 is not divisible by the batch shards (dp×fsdp×ep=8) × "
            "training.gradient_accumulation_steps=1 = 8; use a multiple of 8, e.g. 8",
        ),
        (
            "training.stepz=3",
            "unknown config key 'training.stepz' (did you mean 'training.steps'?)",
        ),
        (
            "+training.stepz=3",
            "unknown config key 'training.stepz' (did you mean 'training.steps'?)",
        ),
        (
            "data.mixture=[{name:a,path:[x]}]",
            "meshtrain: error: unknown config key 'data.mixture[0].path' (did you mean 'paths'?); "
            "a data.mixture entry has the keys name, paths, weight",
        ),
        (
            "data.mixture=[{name:a,paths:[x]},{nme:b}]",
            "meshtrain: error: unknown config key 'data.mixture[1].nme' (did you mean 'name'?); "
            "a data.mixture entry has the keys name, paths, weight",
        ),
        (
            "data={mixture:[{name:a,pth:[x]}]}",
            "meshtrain: error: unknown config key 'pth' in a data.mixture entry (did you mean "
            "'paths'?); a data.mixture entry has the keys name, paths, weight",
        ),
        (
            "model=llama3",
            "model=llama3 is not a config in configs/model/ (did you mean 'llama3_1b'?); "
            "choose one of: gemma3_12b, gemma3_1b,",
        ),
        ("training.steps=many", "bad value for 'training.steps'"),
        (
            "training.lr_schedule=linear",
            "training.lr_schedule='linear' is not supported; use one of: cosine, constant",
        ),
        (
            "model.mesh_shape=[[8,1],[fsdp,tp]] data=text data.paths=[/no/such/corpus.jsonl]",
            "data.paths: '/no/such/corpus.jsonl' does not exist; give a file, a directory or a "
            "glob",
        ),
        (
            "data=prepared",
            "data.source=prepared needs data.path=DIR, a directory made by "
            "python -m meshtrain.data.prepare --out DIR ...",
        ),
        (
            "data=text",
            "data=text needs data.paths: files, directories or globs of documents, e.g. "
            "'data.paths=[corpus/*.jsonl]'",
        ),
        (
            "model.mesh_shape=[[8,1],[fsdp,tp]] logging.trackers=[tensorboard,neptune]",
            "logging.trackers: 'neptune' is not a tracker; use any of: tensorboard, wandb, mlflow",
        ),
        (
            "model.mesh_shape=[[8,1],[fsdp,tp]] data.source=web",
            "data.source='web' is not supported; use one of: text, prepared, synthetic",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(override, expected, tmp_path):
    overrides = override.split(" ")
    run_dir = tmp_path / "outputs" / "tiny" / "2026-01-31" / "12-00-00"
    result = train_command(*overrides, f"hydra.run.dir={run_dir}")
    assert_one_line_error(result, expected)
    assert [p for p in tmp_path.rglob("*") if p != tmp_path / "outputs"] == []  # nothing left


def test_a_rejected_run_keeps_a_directory_that_holds_more_than_hydra_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = train_command("+training.stepz=3", f"hydra.run.dir={tmp_path}")
    assert_one_line_error(result, "unknown config key 'training.stepz'")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # no record of a refused run


def _record(run_dir):
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.glob(".hydra*/**/*.yaml")}


@pytest.mark.slow
def test_the_run_directorys_record_belongs_to_the_run_that_holds_it(tmp_path):
    run = ("data=synthetic", "data.seq_len=32", "model.num_layers=1", f"hydra.run.dir={tmp_path}")
    first = train_command(*run, "training.steps=2", "checkpoint.every_steps=2", devices=1)
    assert first.returncode == 0, first.stderr
    record = _record(tmp_path)
    assert set(record) == {
        Path(".hydra/config.yaml"),
        Path(".hydra/hydra.yaml"),
        Path(".hydra/overrides.yaml"),
    }
    # Refused by a bad key, by a changed setting on resume: the first run's record stays as it
    # was, byte for byte, and the refused commands leave none.
    bad = train_command(*run, "training.steps=4", "model.lora.rank=-4", devices=1)
    assert_one_line_error(bad, "model.lora.rank=-4 must be positive")
    changed = train_command(*run, "training.steps=4", "training.seed=7", devices=1)
    assert_one_line_error(changed, "training.seed 0 → 7")
    assert _record(tmp_path) == record
    # A resumed start keeps its own record beside the first one's.
    resumed = train_command(*run, "training.steps=3", devices=1)
    assert resumed.returncode == 0, resumed.stderr
    now = _record(tmp_path)
    assert {k: v for k, v in now.items() if k in record} == record
    (start,) = {k.parent for k in now if k not in record}
    assert start.parent == Path(".hydra/starts")
    assert b"training.steps=3" in now[start / "overrides.yaml"]
    assert not list(tmp_path.glob(".hydra-pending-*"))


def test_cfg_job_prints_the_composed_config_without_training():
    result = train_command("--cfg", "job", "model.mesh_shape=[[4,2],[fsdp,tp]]", "training.steps=7")
    assert result.returncode == 0, result.stderr
    assert "steps: 7" in result.stdout
    assert "- - 4\n    - 2\n  - - fsdp\n    - tp" in result.stdout


def test_help_lists_the_config_groups():
    result = train_command("--help")
    assert result.returncode == 0, result.stderr
    for group in (
        "data: chat, preference, prepared, prompts, stdlib, synthetic, text",
        "experiment: gemma3_270m_chat, gemma3_270m_dpo, gemma3_270m_grpo, qwen3_0_6b_chat, "
        "qwen3_0_6b_dpo, qwen3_0_6b_grpo, tiny_fsdp, tiny_hybrid",
        # every model config, whatever families there are
        "model: " + ", ".join(sorted(p.stem for p in (REPO / "configs/model").glob("*.yaml"))),
        "objective: dpo, grpo, lm",
        "training: default",
    ):
        assert group in result.stdout
    assert (
        "Pick the parallelism with model.mesh_shape=[[sizes...],[axis names...]], e.g.\n"
        "'model.mesh_shape=[[4,2],[fsdp,tp]]' for 4-way FSDP by 2-way tensor parallel; see "
        "docs/parallelism.md.\n"
    ) in result.stdout
    assert "Every key, its type and its doc: src/meshtrain/config/schema.py." in result.stdout
    assert (REPO / "src/meshtrain/config/schema.py").is_file()
    assert "config.py" not in result.stdout.replace("config/schema.py", "")


@pytest.mark.slow
def test_train_from_the_command_line_with_a_quoted_mesh(tmp_path):
    env = subprocess_env(8)
    del env["JAX_PLATFORMS"]  # as a user runs it: JAX probes every backend it knows
    result = run_training(
        'model.mesh_shape=[[4,2],["fsdp","tp"]]',
        "data=synthetic",
        "data.seq_len=32",
        "training.steps=3",
        "training.log_every=1",
        "training.eval_every=0",
        f"hydra.run.dir={tmp_path}",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    # The console shows meshtrain's lines only (no JAX INFO lines about backends it lacks).
    for line in result.stdout.splitlines():
        assert re.fullmatch(r"\d\d:\d\d:\d\d (INFO|WARNING) meshtrain\.\S+: .*", line), line
    assert "Unable to initialize backend" not in result.stderr
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert (tmp_path / ".hydra" / "config.yaml").exists()
    assert "step 3/3" in (tmp_path / "train.log").read_text()


@pytest.mark.slow  # about 8 s on 2 cores
def test_multirun_sweep(tmp_path):
    result = run_training(
        "-m",
        "training.seed=0,1",
        *CONSTANT_RUN,  # the program every one-device child of the test run shares
        "training.steps=2",
        f"hydra.sweep.dir={tmp_path}",
        devices=1,
    )
    assert result.returncode == 0, result.stderr
    first = [json.loads(x) for x in (tmp_path / "0" / "metrics.jsonl").read_text().splitlines()]
    second = [json.loads(x) for x in (tmp_path / "1" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in first] == [x["step"] for x in second] == [1, 2]
    assert first[0]["loss"] != second[0]["loss"]  # different seeds, different init


@pytest.mark.slow  # about 9 s on 2 cores
def test_on_a_terminal_a_live_bar_moves_between_log_steps(tmp_path):
    """stdout on a pseudo-terminal, as in an interactive shell: the bar shows steps that are
    not log steps, log lines stay whole above it, and the start-up phases are announced."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [
            sys.executable,
            "run_training.py",
            "data=synthetic",
            "model.num_layers=1",  # seq_len 128 kept: 40 steps of a few redraws' time each
            "training.steps=40",
            "training.log_every=20",
            "training.eval_every=0",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=REPO,
        env=subprocess_env(1),
        stdout=terminal,
        stderr=subprocess.PIPE,
    )
    os.close(terminal)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    assert process.wait(timeout=300) == 0, process.stderr.read().decode()
    os.close(controller)
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", output.decode())
    frames = [frame for frame in re.split(r"[\r\n]", text) if frame.strip()]
    shown = {int(m[1]) for f in frames if (m := re.match(r"step (\d+)/40 ", f))}
    assert len(shown - {20, 40}) >= 2, shown  # steps other than the log steps
    assert 40 in shown
    logged = [f for f in frames if re.match(r"\d\d:\d\d:\d\d INFO meshtrain", f)]
    for announced in ("reading the data", "compiling the train step...", "preparing the train"):
        assert any(announced in line for line in logged), announced
    assert any(line.endswith("eta=?") and "step 1/40" in line for line in logged)
    assert any("step 40/40 loss=" in line for line in logged)  # whole, never cut by the bar
