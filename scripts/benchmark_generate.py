"""Generation speed: tokens/s of `meshtrain.generate` for a model config with random weights.

    python scripts/benchmark_generate.py [--model tiny] [--set model.KEY=VALUE ...]
        [--prompt-tokens 16] [--new-tokens 32] [--runs 3] [--json]

The model is configs/model/MODEL.yaml (plus --set overrides), random weights in fp32 on one
device. The prompt is --prompt-tokens random ids and the tokenizer has no end-of-sequence id
the model can pick, so every call generates exactly --new-tokens tokens, greedily. A first
call compiles (timed apart, as first_call_s); then --runs calls are timed and the median gives
tokens/s = new tokens / seconds per call (prefill included). docs/models.md records the numbers,
with and without the key/value cache (the earlier implementation measured by running this
script against the source of an earlier commit: PYTHONPATH=<that commit's src>).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


class SyntheticTokenizer:
    """Encodes a prompt "N" as N random ids below vocab_size; no bos, and an eos id (-1) that
    no token has, so that generation always runs to max_new_tokens."""

    pad_id = bos_id = eos_id = -1
    source_files: tuple[Path, ...] = ()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> np.ndarray:
        return np.random.default_rng(0).integers(0, self.vocab_size, int(text), dtype=np.int32)

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def model_config(name: str, overrides: list[str]):
    """The ModelConfig `python run_training.py model=NAME OVERRIDES` would build."""
    from hydra import compose, initialize_config_dir

    from meshtrain.config.hydra import register_configs, to_config

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=[f"model={name}", *overrides]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a config of configs/model/ (tiny)")
    parser.add_argument(
        "--set", action="append", default=[], help="a model override, e.g. model.num_layers=4"
    )
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (16)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated (32)")
    parser.add_argument("--runs", type=int, default=3, help="timed calls after the first (3)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)

    import jax
    from flax import nnx

    import meshtrain
    from meshtrain.models.transformer import Transformer

    sys.path.insert(0, str(REPO / "scripts"))
    from benchmark import stamp  # the machine, date and command of every benchmark result

    cfg = model_config(args.model, args.set).model
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokenizer = SyntheticTokenizer(cfg.vocab_size)
    prompt = str(args.prompt_tokens)

    def timed_call() -> float:
        start = time.perf_counter()
        text = meshtrain.generate(model, tokenizer, prompt, max_new_tokens=args.new_tokens)
        seconds = time.perf_counter() - start
        assert len(text.split()) == args.new_tokens, "generation stopped early"
        return seconds

    first = timed_call()
    seconds = [timed_call() for _ in range(args.runs)]
    median = statistics.median(seconds)
    result = {
        "model": args.model,
        "overrides": args.set,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "tokens_per_sec": args.new_tokens / median,
        "median_s": median,
        "runs_s": seconds,
        "first_call_s": first,
        "devices": 1,
        "jax": jax.__version__,
        "meshtrain": str(Path(meshtrain.__file__).parent),
    }
    result = stamp(result, sys.argv[1:] if argv is None else list(argv), "benchmark_generate.py")
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.model}: {args.prompt_tokens} prompt + {args.new_tokens} new tokens, "
            f"{result['tokens_per_sec']:.1f} tokens/s (median of {args.runs}: {median:.3f} s; "
            f"first call {first:.2f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
