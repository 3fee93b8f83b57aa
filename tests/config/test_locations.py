"""The paths a run records are absolute, so that its directory travels, and a tokenizer that
moved with its project is found again by its contents."""

import shutil

import pytest
from helpers.config import compose_config
from helpers.paths import REPO
from helpers.runs import train_tiny

from meshtrain.config.locations import with_absolute_paths
from meshtrain.errors import ConfigError
from meshtrain.weights.load import load_tokenizer

GEMMA = REPO / "tests" / "fixtures" / "chat" / "gemma3"


def test_existing_paths_become_absolute_and_names_stay(tmp_path, monkeypatch):
    (tmp_path / "base").mkdir()
    (tmp_path / "weights").mkdir()
    (tmp_path / "rewards.py").write_text("def f(**kwargs): ...\n")
    monkeypatch.chdir(tmp_path)
    cfg = with_absolute_paths(
        compose_config(
            "data.tokenizer=base",
            "model.init_from=hf:base",
            "checkpoint.load_params=weights",
            "model.lora.init_from=peft:missing",
            "objective.rewards=[rewards.py:f,json:dumps,missing.py:g]",
        )
    )
    assert cfg.objective.rewards == [f"{tmp_path / 'rewards.py'}:f", "json:dumps", "missing.py:g"]
    assert cfg.data.tokenizer == str(tmp_path / "base")
    assert cfg.model.init_from == f"hf:{tmp_path / 'base'}"
    assert cfg.checkpoint.load_params == str(tmp_path / "weights")
    assert cfg.model.lora.init_from == "peft:missing"  # left for its own check to name
    assert with_absolute_paths(compose_config()).data.tokenizer == "byte"
    assert compose_config("data.paths=[a]").data.paths == ["a"]  # compared by value on resume


@pytest.mark.slow
def test_a_run_directory_is_read_from_another_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    relative = GEMMA.relative_to(REPO)
    train_tiny(
        tmp_path / "run",
        "data=synthetic",
        f"data.tokenizer={relative}",
        "model.vocab_size=512",
        "data.seq_len=32",
        "model.num_layers=1",
        "training.steps=1",
        devices=1,
    )
    monkeypatch.chdir(tmp_path)  # meshtrain-eval or -generate started elsewhere
    assert load_tokenizer(tmp_path / "run").vocab_size == load_tokenizer(GEMMA).vocab_size


@pytest.mark.slow
def test_a_moved_project_finds_its_tokenizer_by_its_contents(tmp_path, caplog):
    project = tmp_path / "project"
    (project / "tok").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(GEMMA / name, project / "tok" / name)
    (project / "docs").mkdir()
    (project / "docs" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    train_tiny(
        project / "outputs" / "run",
        f"data.paths=[{project / 'docs'}]",
        f"data.tokenizer={project / 'tok'}",
        "data.validation_fraction=0",
        "model.vocab_size=512",
        "data.seq_len=32",
        "model.num_layers=1",
        "training.steps=1",
        devices=1,
    )
    moved = tmp_path / "elsewhere" / "project"
    shutil.move(project, moved)  # the recorded tokenizer path is gone
    tokenizer = load_tokenizer(moved / "outputs" / "run")
    assert tokenizer.source_files[0] == moved / "tok" / "tokenizer.json"
    assert f"data.tokenizer {project / 'tok'} is gone; using {moved / 'tok'}" in caplog.text
    # Other contents under the same name are not the run's tokenizer.
    shutil.copy(GEMMA.parent / "qwen3" / "tokenizer.json", moved / "tok" / "tokenizer.json")
    with pytest.raises(
        ConfigError, match=r"was trained with data\.tokenizer=.*, which is not found"
    ):
        load_tokenizer(moved / "outputs" / "run")
