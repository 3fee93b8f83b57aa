"""training.epochs: the steps of that many passes over the training sequences, and the log line
where each pass begins."""

import logging

import pytest
from helpers.runs import train_tiny
from helpers.short_training import SHORT_TEXT

from meshtrain.config.epochs import epoch_steps
from meshtrain.errors import ConfigError
from meshtrain.train.hooks.base import StepInfo
from meshtrain.train.hooks.epochs import EpochLog


def test_epochs_are_the_steps_that_draw_them():
    assert epoch_steps(3, 264, 8) == 99  # 792 sequences
    assert epoch_steps(0.5, 264, 8) == 17  # 132 sequences: 16.5 steps, the last one whole
    assert epoch_steps(1, 10, 20) == 1
    assert epoch_steps(0.1, 30, 3) == 1


def _logged(sequences, global_batch, steps, caplog, start=0):
    caplog.clear()
    hook = EpochLog(sequences, global_batch, lambda k: start + k * global_batch)
    for step in range(1, steps + 1):
        assert hook(StepInfo(step, None, {}, step == 1, step == steps, False)) == {}
    return [r.getMessage() for r in caplog.records]


def test_the_log_says_where_each_epoch_begins(caplog):
    caplog.set_level(logging.INFO, logger="meshtrain.train.hooks.epochs")
    # 10 sequences, 4 per step: step 3 takes 8-11, step 6 takes 20-23.
    assert _logged(10, 4, 6, caplog) == [
        "data: epoch 2 begins at step 3 (10 training sequences per epoch)",
        "data: epoch 3 begins at step 6 (10 training sequences per epoch)",
    ]
    # A step longer than an epoch: step 1 takes 0-24.
    assert _logged(10, 25, 2, caplog) == [
        "data: epochs 2-3 begin at step 1 (10 training sequences per epoch)",
        "data: epochs 4-5 begin at step 2 (10 training sequences per epoch)",
    ]
    # An epoch that ends exactly with a step: the next one begins with the next step.
    assert _logged(8, 4, 3, caplog) == [
        "data: epoch 2 begins at step 3 (8 training sequences per epoch)"
    ]


def test_a_run_of_epochs_takes_their_steps_and_logs_them(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"{i}.txt").write_text("abc " * (7 + i))
    run = (f"data.paths=[{docs}]", "data.validation_fraction=0", "training.log_every=1")
    result = train_tiny(tmp_path / "run", *run, "training.epochs=2.5", *SHORT_TEXT, devices=1)
    out = capsys.readouterr().out
    sequences = len(result.setup.train_data)
    steps = epoch_steps(2.5, sequences, 8)
    # 12 documents of 28 to 72 bytes, each with bos and eos (624 tokens), in rows of 33 tokens.
    assert (sequences, steps) == (19, 6)  # 2.5 × 19 = 47.5 sequences: 6 steps of 8
    assert [h["step"] for h in result.history] == list(range(1, steps + 1))
    assert result.setup.cfg.training.steps == steps  # saved with the checkpoints
    assert "training.epochs=2.5: 6 steps of 8 sequences\n" in out
    # Step 3 takes sequences 16-23 of the stream (the 20th is the second epoch's first), step 5
    # takes 32-39 (the 39th, the third's).
    assert "data: epoch 2 begins at step 3 (19 training sequences per epoch)\n" in out
    assert "data: epoch 3 begins at step 5 (19 training sequences per epoch)\n" in out


def test_epochs_of_a_mixture_are_refused_in_one_line(tmp_path):
    mixture = f"data.mixture=[{{name:a,paths:[{tmp_path}],weight:1}}]"
    with pytest.raises(ConfigError) as err:
        train_tiny(tmp_path / "run", mixture, "training.epochs=1", devices=1)
    assert str(err.value) == (
        "training.epochs=1.0 cannot apply to data.mixture, which draws its sources by weight "
        "(no pass over them ends); set training.steps instead"
    )
