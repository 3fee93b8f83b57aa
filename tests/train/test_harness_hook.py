"""eval.harness inside training: the harness tasks' metrics are logged at the right steps (to the
console, metrics.jsonl and the trackers as eval/<task>/<metric>), equal to a standalone
evaluation of the final parameters, and the training losses are bit-identical to a run
without them; bad eval.harness input is one line."""

import json

import pytest
from helpers import tiny_hf
from helpers.config import compose_config
from helpers.harness import EXAMPLE_TASKS, write_tiny_llama
from helpers.runs import train_tiny

pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")

from meshtrain.config.validate import check_config
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import ConfigError
from meshtrain.harness.run import evaluate_in_place
from meshtrain.observe.trackers.run_info import metric_tag
from meshtrain.weights.load import load_checkpoint


def _run(tmp_path, base, *extra):
    return train_tiny(
        tmp_path,
        *tiny_hf.overrides("llama", base),
        "data=synthetic",
        "data.seq_len=32",
        f"data.tokenizer={base}",
        "model.mesh_shape=[[4,2],[fsdp,tp]]",
        "training.global_batch_size=8",
        "training.steps=4",
        "training.log_every=1",
        "training.eval_every=0",
        "checkpoint.every_steps=0",
        *extra,
        devices=8,
    )


@pytest.mark.slow  # two 4-step runs and four evaluations, about 11 s
def test_harness_metrics_at_their_steps_and_the_same_losses(tmp_path):
    base = write_tiny_llama(tmp_path / "base")
    harness = (
        "eval.harness.tasks=[meshtrain_choice,meshtrain_generate]",
        "eval.harness.every=2",
        "eval.harness.limit=4",
        f"eval.harness.include_path=[{EXAMPLE_TASKS}]",
    )
    with_harness = _run(tmp_path / "with", base, *harness)
    without = _run(tmp_path / "without", base)
    assert [h["loss"] for h in with_harness.history] == [h["loss"] for h in without.history]
    logged = [json.loads(line) for line in (tmp_path / "with" / "metrics.jsonl").open()]
    evaluated = [entry["step"] for entry in logged if "eval/meshtrain_choice/acc" in entry]
    assert evaluated == [2, 4]
    # The last evaluation is that of the final parameters, evaluated on their own.
    model, tokenizer = load_checkpoint(tmp_path / "with"), build_tokenizer(str(base))
    alone = evaluate_in_place(
        model,
        tokenizer,
        ["meshtrain_choice", "meshtrain_generate"],
        limit=4,
        include_path=[EXAMPLE_TASKS],
        max_length=with_harness.setup.cfg.model.max_seq_len,
    )
    last = logged[-1]
    for task, metrics in alone.items():
        for metric, value in metrics.items():
            assert last[f"eval/{task}/{metric}"] == pytest.approx(value, abs=1e-6)
    assert metric_tag("eval/meshtrain_choice/acc") == "eval/meshtrain_choice/acc"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("eval.harness.every=-1",), "eval.harness.every=-1 must be >= 0 (0: last step)"),
        (
            ("eval.harness.limit=0",),
            "eval.harness.limit=0.0 must be positive, or null for every document",
        ),
    ],
)
def test_bad_harness_keys_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_config(compose_config(*overrides))
    assert str(err.value) == message


@pytest.mark.slow  # lm-eval's task index, about 7 s
def test_an_unknown_task_stops_the_run_before_it_trains(tmp_path):
    base = write_tiny_llama(tmp_path / "base")
    with pytest.raises(ConfigError, match="nosuchtask"):
        _run(tmp_path / "run", base, "eval.harness.tasks=[nosuchtask]")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "plan.json").exists()  # refused before the step compiled
