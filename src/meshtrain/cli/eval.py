"""`python -m meshtrain.eval <checkpoint> --tasks T1,T2 [--limit K]` (or `meshtrain-eval`):
evaluate a model on lm-eval harness tasks (docs/evaluation.md).

<checkpoint> is what `meshtrain.generate` takes: a meshtrain checkpoint (a step directory, its
checkpoints/ directory, a run directory), any `meshtrain.export` output, or a Hugging Face
checkpoint directory. The tasks are lm-eval's own (their data downloaded from the Hugging Face
hub) or those of --include-path directories (examples/eval_tasks: local files). The harness's
results JSON goes to --output, by default into the run directory (eval/step_<N>.json for the
newest checkpoint of a run, else <checkpoint>/eval/results.json), and its table is printed.

Everything the command is given is checked before the model loads: the directory, the
model_args (harness.options), the tasks; a bad one is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

from meshtrain.checkpoint.layout import find_checkpoints
from meshtrain.cli.exit import fail
from meshtrain.cli.train import skip_gpu_plugin_without_gpu
from meshtrain.errors import ConfigError, first_line
from meshtrain.harness.options import parse_mesh_shape, parse_model_args, split_model_args
from meshtrain.prog import prog_name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog_name("meshtrain.eval"),
        description="Evaluate a meshtrain or Hugging Face checkpoint on lm-eval harness tasks; "
        "write the harness's results JSON and print its table.",
    )
    parser.add_argument(
        "checkpoint",
        help="meshtrain checkpoint, checkpoints/ or run directory; a meshtrain.export output; "
        "or a Hugging Face directory (config.json, *.safetensors, tokenizer)",
    )
    parser.add_argument(
        "--tasks",
        required=True,
        help="comma-separated harness tasks or groups, e.g. meshtrain_choice,meshtrain_generate "
        "(with --include-path examples/eval_tasks) or hellaswag,arc_easy",
    )
    parser.add_argument(
        "--include-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory of task YAMLs besides lm-eval's own (repeatable)",
    )
    parser.add_argument(
        "--limit", type=float, help="at most this many documents per task (below 1: a fraction)"
    )
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt")
    parser.add_argument(
        "--model-args",
        default="",
        metavar="KEY=VALUE,...",
        help="tokenizer, dtype (float32|bfloat16), max_length, batch_tokens, add_bos_token, "
        "max_gen_toks, as lm-eval's --model_args (docs/evaluation.md)",
    )
    parser.add_argument(
        "--mesh-shape", help='shard the model over the visible devices, e.g. [[4,2],["fsdp","tp"]]'
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="the results JSON (default: eval/step_<N>.json in the run directory, else "
        "eval/results.json in the checkpoint directory)",
    )
    parser.add_argument(
        "--log-samples", action="store_true", help="keep each request's responses in the JSON"
    )
    parser.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="render each prompt with the tokenizer's chat template, as lm-eval's "
        "--apply_chat_template (for chat and instruction-tuned models)",
    )
    parser.add_argument(
        "--fewshot-as-multiturn",
        action="store_true",
        help="with --apply-chat-template: the few-shot examples as turns of the chat",
    )
    parser.add_argument(
        "--bootstrap-iters",
        type=int,
        default=100000,
        help="bootstrap resamples for the standard errors of non-mean metrics (0: none)",
    )
    return parser


def default_output(path: Path) -> Path:
    """Where the results of the model at `path` go without --output: eval/step_<N>.json in the
    run directory of a meshtrain checkpoint (N the newest step), else eval/results.json in
    `path` itself."""
    found = find_checkpoints(path)
    if found and found[0].parent.name == "checkpoints":
        return found[0].parent.parent / "eval" / f"step_{found[0].name}.json"
    return path / "eval" / "results.json"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(format="meshtrain: %(message)s", level=logging.WARNING)
    skip_gpu_plugin_without_gpu()  # before JAX starts: no CUDA failure printed on a CPU host
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's own lines about each read
    path = Path(args.checkpoint).expanduser()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        if not path.is_dir():
            raise ConfigError(
                f"{path} is not a directory; pass a meshtrain checkpoint (or its run directory), "
                "an export or a Hugging Face checkpoint directory (config.json, *.safetensors)"
            )
        if not tasks:
            raise ConfigError("--tasks names no task")
        if args.fewshot_as_multiturn and not args.apply_chat_template:
            raise ConfigError(
                "--fewshot-as-multiturn lays the few-shot examples out as chat turns; add "
                "--apply-chat-template"
            )
        model_args = split_model_args(args.model_args)
        if "checkpoint" in model_args or "mesh_shape" in model_args:
            raise ConfigError(
                "--model-args holds neither checkpoint (the first argument) nor mesh_shape "
                "(--mesh-shape)"
            )
        if args.mesh_shape is not None:
            model_args["mesh_shape"] = parse_mesh_shape(args.mesh_shape)
        model_args["checkpoint"] = str(path)
        parse_model_args(model_args)  # every key and value, before anything loads
        output = args.output or default_output(path)
        if importlib.util.find_spec("lm_eval") is None:  # after the input: that error first
            fail("meshtrain-eval needs lm-eval: pip install 'meshtrain[eval]' (lm_eval>=0.4.13)")
        from meshtrain.harness.run import run_tasks, task_manager  # imports lm-eval

        task_manager(tasks, args.include_path)  # unknown tasks, before the model loads
        from meshtrain.harness.lm import MeshtrainLM

        lm = MeshtrainLM(**model_args)
        try:
            results = run_tasks(
                lm,
                tasks,
                include_path=args.include_path,
                limit=int(args.limit) if args.limit and args.limit >= 1 else args.limit,
                num_fewshot=args.num_fewshot,
                bootstrap_iters=args.bootstrap_iters,
                log_samples=args.log_samples,
                model_args=model_args,
                apply_chat_template=args.apply_chat_template,
                fewshot_as_multiturn=args.fewshot_as_multiturn,
            )
        except ConfigError:
            raise
        except Exception as err:  # a task's own failure: its template, its data, lm-eval
            if os.environ.get("MESHTRAIN_DEBUG") == "1":
                raise
            raise ConfigError(
                f"tasks {', '.join(tasks)} failed: {type(err).__name__}: {first_line(err)}; fix the task "
                "(its YAML, template or data), or run with MESHTRAIN_DEBUG=1 for the traceback"
            ) from None
    except ConfigError as err:
        fail(str(err))
    _write(results, output)
    _print_tables(results)
    print(f"results: {output}")
    return 0


def _write(results: dict, output: Path) -> None:
    from lm_eval.utils import handle_non_serializable

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
        output.write_text(text + "\n", encoding="utf-8")
    except OSError as err:
        fail(f"cannot write the results to {output} ({err.strerror}); pass --output FILE")


def _print_tables(results: dict) -> None:
    """The harness's own tables, as `lm-eval run` prints them."""
    from lm_eval.utils import make_table

    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))


if __name__ == "__main__":
    sys.exit(main())
