"""Harness tasks run on a meshtrain model: `run_tasks` (lm-eval's evaluation, its results dict),
`evaluate_tasks` (the same for any lm-eval model), `task_metrics` (that dict as {task: {metric:
value}}) and `evaluate_in_place`, what a training loop calls with its current parameters.

The tasks are lm-eval's own (downloaded from the Hugging Face hub where this machine can reach
it) and the task YAMLs of `include_path` directories (examples/eval_tasks: local files, no
network). lm-eval is imported on first use, not by `import meshtrain.harness.run`.

Unlike lm-eval's simple_evaluate, nothing here imports torch or collects the environment's
description (torch's collect_env takes seconds): the results hold lm-eval's per-task results,
configs and versions, and a config naming the model and the evaluation's settings.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from meshtrain.data.tokenizer import Tokenizer
from meshtrain.errors import ConfigError, did_you_mean
from meshtrain.models.transformer import Transformer

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

    from meshtrain.harness.lm import MeshtrainLM

FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed


class _CustomDatasetNotice(logging.Filter):
    """Drops lm-eval's warning, at each load of a task with a `custom_dataset` (the local
    tasks' loader), that such tasks take keyword arguments through --metadata: ours take none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


@functools.cache
def _task_manager(include_path: tuple[str, ...], include_defaults: bool) -> TaskManager:
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval.api.task").addFilter(_CustomDatasetNotice())
    return TaskManager(include_path=list(include_path) or None, include_defaults=include_defaults)


def task_manager(tasks: Sequence[str], include_path: Sequence[str | Path] = ()) -> TaskManager:
    """lm-eval's TaskManager that knows every task of `tasks`: the YAMLs of `include_path`
    alone when they hold them all (fast), else those and lm-eval's own (seconds to index).
    ConfigError names the first task neither holds."""
    paths = tuple(str(Path(p).expanduser()) for p in include_path)
    for path in paths:
        if not Path(path).exists():
            raise ConfigError(f"include path {path} does not exist")
    if paths:
        local = _task_manager(paths, False)
        if all(task in local.all_tasks for task in tasks):
            return local
    manager = _task_manager(paths, True)
    for task in tasks:
        if task not in manager.all_tasks:
            if broken := _unreadable_yaml(paths):
                raise ConfigError(
                    f"task {task!r} does not exist: {broken}, which lm-eval passes over; fix it"
                )
            where = f"lm-eval's tasks or {', '.join(paths)}" if paths else "lm-eval's tasks"
            raise ConfigError(
                f"task {task!r} does not exist{did_you_mean(task, manager.all_tasks)} in "
                f"{where}; list them with `lm-eval ls tasks`, or add --include-path DIR"
            )
    return manager


class _TaskYamlLoader(yaml.SafeLoader):
    """YAML as lm-eval's task files are written: its `!function` tags read as plain values."""


_TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _unreadable_yaml(paths: Sequence[str]) -> str | None:
    """The first task YAML under `paths` that does not parse, as "FILE line N: error"."""
    for path in paths:
        for file in sorted(Path(path).rglob("*.yaml")):
            try:
                yaml.load(file.read_text(encoding="utf-8"), Loader=_TaskYamlLoader)
            except yaml.YAMLError as err:
                mark = getattr(err, "problem_mark", None)
                line = f" line {mark.line + 1}" if mark is not None else ""
                problem = getattr(err, "problem", None) or type(err).__name__
                return f"{file}{line}: {problem}"
    return None


def run_tasks(
    lm: MeshtrainLM,
    tasks: Sequence[str],
    *,
    include_path: Sequence[str | Path] = (),
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 100000,
    log_samples: bool = False,
    model_args: dict[str, Any] | None = None,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = False,
) -> dict[str, Any] | None:
    """lm-eval's results of `tasks` for `lm` (its results dict: results, configs, versions,
    n-shot, ...; with log_samples each request's responses too). On process 0; a multi-process
    run's other processes follow process 0's commands (harness.engine) and get None."""
    engine = lm.engine
    if not engine.is_driver:
        engine.follow()
        return None
    try:
        manager = task_manager(tasks, include_path)
        results = evaluate_tasks(
            lm,
            manager,
            tasks,
            limit=limit,
            num_fewshot=num_fewshot,
            bootstrap_iters=bootstrap_iters,
            log_samples=log_samples,
            apply_chat_template=apply_chat_template,
            fewshot_as_multiturn=fewshot_as_multiturn,
        )
    finally:
        engine.release()
    results["config"] = {
        "model": "meshtrain",
        "model_args": model_args or {},
        **lm.get_model_info(),
        "batch_tokens": engine.batch_tokens,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "bootstrap_iters": bootstrap_iters,
        "fewshot_seed": FEWSHOT_SEED,
        "apply_chat_template": apply_chat_template,
        "fewshot_as_multiturn": fewshot_as_multiturn,
    }
    results["date"] = time.time()
    return results


def evaluate_tasks(
    lm: Any,
    manager: TaskManager,
    tasks: Sequence[str],
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 100000,
    log_samples: bool = False,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = False,
) -> dict[str, Any]:
    """lm-eval's evaluate() of `tasks` for any lm-eval model `lm`, on one process, with the
    few-shot settings simple_evaluate gives the tasks (but none of its torch seeding and
    environment collection). apply_chat_template: each prompt rendered by the model's chat
    template (lm-eval's --apply_chat_template); fewshot_as_multiturn: its few-shot examples as
    turns of that chat."""
    from lm_eval import __version__
    from lm_eval.evaluator import evaluate

    loaded = manager.load(list(tasks))
    for task in loaded["tasks"].values():
        # A task that sets num_fewshot: 0 keeps it; otherwise num_fewshot, else its own or 0.
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    results = evaluate(
        lm=lm,
        task_dict=loaded,
        limit=limit,
        bootstrap_iters=bootstrap_iters,
        log_samples=log_samples,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn,
    )
    results["lm_eval_version"] = __version__
    return results


def task_metrics(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of lm-eval's results (groups included): the numbers only, no
    standard errors; a metric under a filter other than "none" is named metric/filter."""
    metrics: dict[str, dict[str, float]] = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr") or isinstance(value, str | bool):
                continue
            name = metric if filter_name == "none" else f"{metric}/{filter_name}"
            metrics.setdefault(task, {})[name] = float(value)
    return metrics


def evaluate_in_place(
    model: Transformer,
    tokenizer: Tokenizer,
    tasks: Sequence[str],
    *,
    limit: int | float | None = None,
    include_path: Sequence[str | Path] = (),
    num_fewshot: int | None = None,
    max_length: int | None = None,
    batch_tokens: int = 4096,
    add_bos_token: bool | None = None,
    generate_batch: int = 16,
) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of harness `tasks` (at most `limit` documents each) for `model`
    as it is: its arrays where they are, on their mesh (a training loop passes
    models.abstract.merge_model(setup.model, setup.model.full_params(state.params,
    state.frozen)): the state's own arrays, no copy). Every process of a multi-process run must
    call it; process 0 runs the harness, the others run its programs, and all return the same
    metrics. max_length: the model's max_seq_len (default 2048). No standard errors are computed
    (bootstrap_iters=0). Compiles at most a few programs (harness.programs), reused by the next
    call with parameters of the same shapes."""
    from meshtrain.harness.lm import MeshtrainLM

    lm = MeshtrainLM.from_model(
        model,
        tokenizer,
        max_length=max_length,
        batch_tokens=batch_tokens,
        add_bos_token=add_bos_token,
        generate_batch=generate_batch,
    )
    lm.progress = False  # a training run's console has its own
    engine = lm.engine
    if not engine.is_driver:
        return engine.follow() or {}
    metrics: dict[str, dict[str, float]] | None = None
    try:
        manager = task_manager(tasks, include_path)
        results = evaluate_tasks(
            lm, manager, tasks, limit=limit, num_fewshot=num_fewshot, bootstrap_iters=0
        )
        metrics = task_metrics(results)
    finally:
        engine.release(metrics)  # the other processes return the same metrics
    return metrics
