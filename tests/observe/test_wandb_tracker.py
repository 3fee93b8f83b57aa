"""The W&B tracker's settings: logging.wandb first, then W&B's own environment.
(tests/observe/test_trackers.py runs it for real, offline.)"""

import pytest

wandb_tracker = pytest.importorskip("meshtrain.observe.trackers.wandb_tracker")
WandbConfig = wandb_tracker.WandbConfig


def test_the_project_is_the_key_else_wandbs_variable_else_meshtrain():
    assert wandb_tracker.project_name(WandbConfig(project="mine"), {"WANDB_PROJECT": "env"}) == (
        "mine"
    )
    assert wandb_tracker.project_name(WandbConfig(), {"WANDB_PROJECT": "env"}) == "env"
    assert wandb_tracker.project_name(WandbConfig(), {}) == "meshtrain"


def test_the_run_files_go_under_wandb_dir_when_the_user_set_it(tmp_path):
    run_dir = tmp_path / "run"
    assert wandb_tracker.run_files_dir(run_dir, {}) == str(run_dir)
    assert wandb_tracker.run_files_dir(run_dir, {"WANDB_DIR": "/scratch/wandb"}) == (
        "/scratch/wandb"
    )
