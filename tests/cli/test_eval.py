"""`python -m meshtrain.eval`: bad input is one line and exit code 2, before any model loads;
the results JSON lands in the run directory (or --output) with the metrics evaluate_in_place
computes, and the harness's table is printed."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers.commands import module_command
from helpers.harness import (
    EXAMPLE_TASKS,
    MAX_LENGTH,
    METRICS,
    TASKS,
    write_broken_task,
    write_tiny_llama,
)
from helpers.process import run_python

import meshtrain
from meshtrain.cli.eval import default_output

KEYS = (
    "checkpoint, tokenizer, mesh_shape, dtype, max_length, batch_tokens, add_bos_token, "
    "generate_batch, max_gen_toks"
)


def _error(result) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def test_bad_input_is_one_line(tmp_path):
    missing = tmp_path / "nope"
    result = module_command("meshtrain.eval", [missing, "--tasks", "meshtrain_choice"])
    assert _error(result) == (
        f"meshtrain: error: {missing} is not a directory; pass a meshtrain checkpoint (or its run "
        "directory), an export or a Hugging Face checkpoint directory (config.json, "
        "*.safetensors)"
    )
    args = [tmp_path, "--tasks", "t", "--model-args", "batch_tokenz=8"]
    result = module_command("meshtrain.eval", args)
    assert _error(result) == (
        "meshtrain: error: model_args key 'batch_tokenz' does not exist (did you mean "
        f"'batch_tokens'?); the keys are {KEYS}"
    )
    result = module_command("meshtrain.eval", [tmp_path, "--tasks", "t", "--fewshot-as-multiturn"])
    assert _error(result) == (
        "meshtrain: error: --fewshot-as-multiturn lays the few-shot examples out as chat turns; "
        "add --apply-chat-template"
    )


def test_without_lm_eval_the_input_is_checked_first_then_named(tmp_path, monkeypatch):
    """Without the eval extra, bad input is still its own one line; good input is told which
    package it needs, before any model loads."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "lm_eval" else find_spec(name, *a),
    )
    result = module_command("meshtrain.eval", [tmp_path / "nope", "--tasks", "meshtrain_choice"])
    assert "is not a directory" in _error(result)
    result = module_command("meshtrain.eval", [tmp_path, "--tasks", "meshtrain_choice"])
    assert _error(result) == (
        "meshtrain: error: meshtrain-eval needs lm-eval: pip install 'meshtrain[eval]' "
        "(lm_eval>=0.4.13)"
    )


def test_results_go_into_the_run_directory(tmp_path):
    run = tmp_path / "run"
    for step in (100, 200):
        for item in ("params", "meta"):
            (run / "checkpoints" / str(step) / item).mkdir(parents=True)
    assert default_output(run) == run / "eval" / "step_200.json"
    assert default_output(run / "checkpoints" / "100") == run / "eval" / "step_100.json"
    assert default_output(tmp_path) == tmp_path / "eval" / "results.json"


@pytest.mark.slow  # lm-eval indexes its own 14,000 tasks to tell they lack it: ~10 s
def test_an_unknown_task_is_one_line(tmp_path):
    pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    args = ("--tasks", "meshtrain_choise", "--include-path", EXAMPLE_TASKS)
    result = run_python("-m", "meshtrain.eval", tmp_path, *args)
    assert _error(result) == (
        "meshtrain: error: task 'meshtrain_choise' does not exist (did you mean "
        f"'meshtrain_choice'?) in lm-eval's tasks or {EXAMPLE_TASKS}; list them with "
        "`lm-eval ls tasks`, or add --include-path DIR"
    )


def test_a_task_yaml_that_does_not_parse_is_named(tmp_path):
    pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    tasks = write_broken_task(tmp_path / "tasks", yaml_error=True)
    args = ("--tasks", "meshtrain_broken", "--include-path", tasks)
    result = module_command("meshtrain.eval", [tmp_path, *args])
    line = _error(result)
    assert line.startswith(
        f"meshtrain: error: task 'meshtrain_broken' does not exist: {tasks / 'meshtrain_broken.yaml'}"
        " line "
    )
    assert line.endswith(", which lm-eval passes over; fix it")


def test_a_task_that_fails_on_its_data_is_one_line(tmp_path):
    pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    checkpoint = write_tiny_llama(tmp_path / "llama")
    tasks = write_broken_task(tmp_path / "tasks")  # its template names a missing field
    args = ("--tasks", "meshtrain_broken", "--include-path", tasks, "--limit", "2")
    result = module_command("meshtrain.eval", [checkpoint, *args])
    assert _error(result) == (
        "meshtrain: error: tasks meshtrain_broken failed: UndefinedError: 'questoin' is "
        "undefined; fix the task (its YAML, template or data), or run with MESHTRAIN_DEBUG=1 "
        "for the traceback"
    )
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # a child process that loads JAX, lm-eval and the model: ~20 s
def test_the_command_writes_the_harness_results(tmp_path):
    pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")
    from meshtrain.harness.run import evaluate_in_place

    checkpoint = write_tiny_llama(tmp_path / "llama")
    args = ("--tasks", ",".join(TASKS), "--include-path", EXAMPLE_TASKS, "--limit", "4")
    result = run_python("-m", "meshtrain.eval", checkpoint, *args, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    output = checkpoint / "eval" / "results.json"
    assert result.stdout.strip().splitlines()[-1] == f"results: {output}"
    assert "|meshtrain_choice    |      1|none  |     0|acc" in result.stdout
    results = json.loads(output.read_text())
    assert results["config"]["model"] == "meshtrain"
    assert results["config"]["max_length"] == MAX_LENGTH  # the checkpoint's
    assert sorted(results["n-samples"]) == sorted(TASKS)
    model, tokenizer = meshtrain.load_hf(checkpoint), meshtrain.build_tokenizer(str(checkpoint))
    expected = evaluate_in_place(
        model, tokenizer, TASKS, limit=4, include_path=[EXAMPLE_TASKS], max_length=MAX_LENGTH
    )
    for task, names in METRICS.items():
        for name in names:
            assert results["results"][task][f"{name},none"] == pytest.approx(
                expected[task][name], rel=1e-6
            )
