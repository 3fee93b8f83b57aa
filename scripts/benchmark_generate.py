"""Generation speed: tokens/s of `meshtrain.generate` for a model config with random weights.

    python scripts/benchmark_generate.py [--model tiny] [--set model.KEY=VALUE ...]
        [--prompt-tokens 16] [--new-tokens 32] [--batch 1] [--repeats 1] [--runs 3]
        [--transformers] [--json]

The model is configs/model/MODEL.yaml (plus --set overrides), random weights in fp32 on one
device. The prompt is --prompt-tokens random ids, and no id stops the generation, so every call
generates exactly --new-tokens tokens, greedily. A first call compiles (timed apart, as
first_call_s); then --runs calls are timed and the median gives tokens/s = new tokens / seconds
per call (prefill included). With --batch N, a call generates for N prompts of --prompt-tokens
(different random ids) decoded together as one batch, and the same N prompts are also timed one
at a time, back to back: tokens/s of both and their ratio. With --transformers (the parity
extra), the same architecture in transformers (its config.json as meshtrain exports it, random
weights, fp32, eager torch on the machine's cores) generates for the same N prompts in one
`generate` call, greedily and exactly --new-tokens tokens, timed the same way after meshtrain.
With --repeats G, the --batch rows are --batch / G prompts each decoded G times, as a GRPO
step's rollouts decode a group (meshtrain prefills each prompt once, generate_ids_batch's
`repeats`; transformers generates for the --batch rows, as trl's GRPOTrainer calls it), and no
one-at-a-time timing. docs/models.md records the numbers
(earlier implementations measured by running this script against the source of an earlier
commit: PYTHONPATH=<that commit's src>).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a config of configs/model/ (tiny)")
    parser.add_argument(
        "--set", action="append", default=[], help="a model override, e.g. model.num_layers=4"
    )
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (16)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated (32)")
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together (1)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="rows a prompt: --batch / repeats prompts (1)"
    )
    parser.add_argument("--runs", type=int, default=3, help="timed calls after the first (3)")
    parser.add_argument(
        "--transformers", action="store_true", help="also time transformers' batched generate"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.batch % args.repeats:
        parser.error(f"--batch {args.batch} is not a multiple of --repeats {args.repeats}")

    import jax
    from flax import nnx

    import meshtrain
    from meshtrain.config.hydra import compose_config
    from meshtrain.inference.generate import generate_ids, generate_ids_batch
    from meshtrain.models.transformer import Transformer

    sys.path.insert(0, str(REPO / "scripts"))
    from benchmark import stamp  # the machine, date and command of every benchmark result

    cfg = compose_config(f"model={args.model}", *args.set).model
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, cfg.vocab_size, args.prompt_tokens, dtype=np.int32)
        for _ in range(args.batch // args.repeats)
    ]
    rows = [prompt for prompt in prompts for _ in range(args.repeats)]  # [batch]

    def timed(call) -> tuple[float, list[float]]:
        """The first call's seconds (it compiles) and the median of --runs more."""

        def seconds() -> float:
            start = time.perf_counter()
            picked = call()
            elapsed = time.perf_counter() - start
            assert all(len(ids) == args.new_tokens for ids in picked), "generation stopped early"
            return elapsed

        first = seconds()
        return first, [seconds() for _ in range(args.runs)]

    # No stop ids: every row generates exactly --new-tokens tokens.
    first, runs = timed(
        lambda: generate_ids_batch(model, prompts, args.new_tokens, repeats=args.repeats)
    )
    median = statistics.median(runs)
    result = {
        "model": args.model,
        "overrides": args.set,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "batch": args.batch,
        "repeats": args.repeats,
        "tokens_per_sec": args.batch * args.new_tokens / median,
        "median_s": median,
        "runs_s": runs,
        "first_call_s": first,
        "devices": 1,
        "jax": jax.__version__,
        "meshtrain": str(Path(meshtrain.__file__).parent),
    }
    if args.batch > 1 and args.repeats == 1:  # the same prompts one at a time, back to back
        _, alone = timed(lambda: [generate_ids(model, p, args.new_tokens) for p in prompts])
        result["one_at_a_time_tokens_per_sec"] = (
            args.batch * args.new_tokens / statistics.median(alone)
        )
        result["one_at_a_time_runs_s"] = alone
        result["batched_speedup"] = statistics.median(alone) / median
    if args.transformers:
        _, theirs = timed(_transformers_generate(cfg, rows, args.new_tokens))
        result["transformers_tokens_per_sec"] = (
            args.batch * args.new_tokens / statistics.median(theirs)
        )
        result["transformers_runs_s"] = theirs
        result["speedup_over_transformers"] = statistics.median(theirs) / median
    result = stamp(result, sys.argv[1:] if argv is None else list(argv), "benchmark_generate.py")
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.model}: {args.batch} × ({args.prompt_tokens} prompt + {args.new_tokens} new "
            f"tokens, {args.repeats} a prompt), {result['tokens_per_sec']:.1f} tokens/s (median of {args.runs}: "
            f"{median:.3f} s; first call {first:.2f} s)"
        )
        if "batched_speedup" in result:
            print(
                f"one at a time: {result['one_at_a_time_tokens_per_sec']:.1f} tokens/s; "
                f"batched {result['batched_speedup']:.2f}× faster"
            )
        if args.transformers:
            print(
                f"transformers' generate: {result['transformers_tokens_per_sec']:.1f} tokens/s; "
                f"meshtrain {result['speedup_over_transformers']:.2f}× as fast"
            )
    return 0


def _transformers_generate(cfg, prompts: list[np.ndarray], new_tokens: int):
    """A call that generates with transformers for `prompts` (one batch, greedy, exactly
    `new_tokens` each): the architecture of `cfg` as meshtrain exports it, random weights."""
    import torch
    import transformers

    from meshtrain.hf.config_json import hf_config_from_model

    torch.set_num_threads(os.cpu_count() or 1)
    config = transformers.AutoConfig.for_model(**hf_config_from_model(cfg, dtype="float32"))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor(np.stack(prompts), dtype=torch.long)

    def call() -> list[np.ndarray]:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return [row[ids.shape[1] :].numpy() for row in out]

    return call


if __name__ == "__main__":
    sys.exit(main())
