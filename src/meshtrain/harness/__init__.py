"""EleutherAI's lm-eval harness on meshtrain models (docs/evaluation.md).

- `lm`: `MeshtrainLM`, lm-eval's model interface, registered as `--model meshtrain`;
- `run`: `run_tasks` (lm-eval's results of tasks for a model), `task_metrics`, and
  `evaluate_in_place(model, tokenizer, tasks, limit=...)` for a training loop;
- `engine`, `programs`, `packing`: the compiled programs and the fixed-shape batches they run
  on, on any mesh, process 0 driving the others;
- `options`: the model_args and their checks;
- `python -m meshtrain.harness ...`: lm-eval's own command line with `--model meshtrain` known.

Nothing here imports lm-eval until it is used (`lm` does, when imported).
"""
