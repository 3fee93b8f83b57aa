"""The loop's hooks (train.hooks): cadences, the order they run in, one record per step, the
hooks' time kept out of the step time, and an evaluation that fails after the checkpoint of its
step is saved (eval.harness.on_error: stop in one line, or warn and train on)."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_hf
from helpers.commands import train_command
from helpers.harness import write_broken_task, write_tiny_llama
from helpers.process import assert_one_line_error

from meshtrain.checkpoint import committed_steps
from meshtrain.train.hooks import AnyOf, Cadence, HookRunner, StepInfo


def _info(step: int, *, first=False, last=False, stop=False) -> StepInfo:
    return StepInfo(step, state=None, metrics={}, first=first, last=last, stop=stop)


def test_a_cadence_is_due_on_any_of_its_conditions():
    every_3 = Cadence(every=3)
    assert [s for s in range(1, 10) if every_3.due(_info(s))] == [3, 6, 9]
    assert not Cadence().due(_info(4))  # every=0: never by count
    assert Cadence(first=True).due(_info(7, first=True))
    assert Cadence(last=True).due(_info(5, last=True))
    assert not Cadence(last=True).due(_info(5, stop=True))
    assert Cadence(stop=True).due(_info(5, stop=True))
    either = AnyOf((Cadence(every=4), Cadence(every=6)))
    assert [s for s in range(1, 13) if either.due(_info(s))] == [4, 6, 8, 12]


class _Hook:
    def __init__(
        self, name, cadence, values, *, part_of_step=False, fail=False, ran=None, after=False
    ):
        self.name, self.cadence, self.values = name, cadence, values
        self.part_of_step, self.fail, self.log = part_of_step, fail, ran
        self.after_record = after

    def __call__(self, info):
        self.log.append((self.name, info.step))
        if self.fail:
            raise RuntimeError(f"{self.name} failed")
        return self.values


def _runner(hooks, written, restarts, ran=None):
    def write(step, record):
        written.append((step, dict(record)))
        if ran is not None:
            ran.append(("record", step))

    return HookRunner(hooks, write=write, restart_clock=restarts.append)


def test_the_due_hooks_run_in_order_and_their_record_is_written_once():
    ran, written, restarts = [], [], []
    hooks = [
        _Hook("metrics", Cadence(every=2), {"loss": 1.0}, part_of_step=True, ran=ran),
        _Hook("eval", Cadence(every=2), {"val_loss": 2.0}, ran=ran),
        _Hook("save", Cadence(every=3), {}, ran=ran, after=True),
    ]
    runner = _runner(hooks, written, restarts, ran)
    for step in range(1, 7):
        runner.run(_info(step))
    # The save follows the step's record: a process killed once it is committed logged the step.
    assert ran == [
        ("metrics", 2),
        ("eval", 2),
        ("record", 2),
        ("save", 3),
        ("metrics", 4),
        ("eval", 4),
        ("record", 4),
        ("metrics", 6),
        ("eval", 6),
        ("record", 6),
        ("save", 6),
    ]
    assert written == [(step, {"loss": 1.0, "val_loss": 2.0}) for step in (2, 4, 6)]
    # The clock restarts after any hook that is not the step's own time: steps 2, 3, 4 and 6.
    assert restarts == [2, 3, 4, 6]
    assert set(runner.seconds) == {"metrics", "save", "eval"}


def test_a_failing_evaluation_leaves_its_record_and_the_checkpoint_due():
    ran, written, restarts = [], [], []
    hooks = [
        _Hook("metrics", Cadence(every=1), {"loss": 1.0}, part_of_step=True, ran=ran),
        _Hook("harness", Cadence(every=1), {"eval/x": 1.0}, fail=True, ran=ran),
        _Hook("later", Cadence(every=1), {"never": 1.0}, ran=ran),
        _Hook("save", Cadence(every=1), {}, ran=ran, after=True),
    ]
    with pytest.raises(RuntimeError, match="harness failed"):
        _runner(hooks, written, restarts, ran).run(_info(5))
    assert ran == [("metrics", 5), ("harness", 5), ("record", 5), ("save", 5)]
    assert written == [(5, {"loss": 1.0})]
    assert restarts == [5]


def test_a_failure_inside_the_step_saves_nothing():
    # The non-finite guard is part of the step: the state it refuses is never saved.
    ran, written, restarts = [], [], []
    hooks = [
        _Hook("metrics", Cadence(every=1), {"loss": 1.0}, part_of_step=True, ran=ran),
        _Hook("guard", Cadence(every=1), {}, part_of_step=True, fail=True, ran=ran),
        _Hook("save", Cadence(every=1), {}, ran=ran, after=True),
    ]
    with pytest.raises(RuntimeError, match="guard failed"):
        _runner(hooks, written, restarts, ran).run(_info(5))
    assert ran == [("metrics", 5), ("guard", 5), ("record", 5)]
    assert restarts == []


@pytest.mark.parametrize("on_error", ["stop", "warn"])
def test_a_broken_harness_task_costs_no_checkpoint(on_error, tmp_path):
    pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    base = write_tiny_llama(tmp_path / "base")
    tasks = write_broken_task(tmp_path / "tasks")
    run_dir = tmp_path / "run"
    result = train_command(
        *tiny_hf.overrides("llama", base),
        f"data.tokenizer={base}",
        "data=synthetic",
        "data.seq_len=32",
        "training.steps=4",
        "training.eval_every=0",
        "checkpoint.every_steps=2",
        "eval.harness.tasks=[meshtrain_broken]",
        f"eval.harness.include_path=[{tasks}]",
        "eval.harness.every=2",
        f"eval.harness.on_error={on_error}",
        f"hydra.run.dir={run_dir}",
        devices=1,
    )
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    if on_error == "stop":
        assert_one_line_error(
            result,
            "eval.harness at step 2 failed on tasks meshtrain_broken: UndefinedError: "
            "'questoin' is undefined; the checkpoint of step 2 is saved where one was due. Fix "
            "the task, or set eval.harness.on_error=warn to train on",
        )
        assert committed_steps(run_dir / "checkpoints") == [2]
        assert steps == [1, 2]  # step 2's training metrics are logged before the error
    else:
        assert result.returncode == 0, result.stderr[-3000:]
        assert committed_steps(run_dir / "checkpoints") == [2, 4]
        assert steps == [1, 2, 4]
        log = (run_dir / "train.log").read_text()
        assert log.count("eval.harness at step") == 2  # steps 2 and 4, each a warning
        assert "training goes on (eval.harness.on_error=warn)" in log
