"""Harness speed: meshtrain's lm-eval model (meshtrain.harness) against lm-eval's own `hf`
model (transformers, PyTorch) on the same checkpoint and machine, on the CPU.

    pip install -e '.[test,parity]'
    python scripts/benchmark_eval.py [--model tiny --model gemma3_270m] [--requests 64]
        [--prompts 8] [--new-tokens 32] [--hf-batch-size 16] [--json]

The checkpoints are built here, nothing is downloaded: `tiny` is a random Llama of the tests'
logit comparisons' shape (3 layers, hidden 64, vocabulary 512), `gemma3_270m` transformers'
Gemma 3 270M (tests/hf_configs/gemma3_270m.json: 18 layers, hidden 640, vocabulary 262,144),
both with random weights (from_config, seed 0, fp32), saved with save_pretrained. Both carry a
512-token BPE tokenizer trained on the Python standard library that starts each text with <bos>
(scripts/docs/make_demo_checkpoint.py's); max_length is 2048 for both models (Gemma's own 32,768
would only make the hf model's rolling windows longer).

- loglikelihood: --requests requests of random token ids, contexts of 32 to 224 tokens and
  continuations of 1 to 8 (the shape of multiple-choice tasks), through each model's
  `_loglikelihood_tokens` (what lm-eval's loglikelihood calls after tokenizing). meshtrain:
  packed batches of 4096 tokens; hf: --hf-batch-size requests per batch, padded.
- generate_until: --prompts prompts (lines of a small Python file), --new-tokens tokens
  each, no stop string (eos only): tokens/s = tokens generated / seconds. meshtrain and hf
  continue --hf-batch-size prompts per batch (meshtrain's generate_batch), hf also 1.

Each is timed warm, --repeats times, and the best time counts (on a shared machine other
processes only slow a call down; `load_average_1min` records the machine's load before and
after): meshtrain's first call compiles (timed apart, `first_call_s`); the hf model runs a few
requests first. The two models'
log-likelihoods are compared (max relative difference) as a check that they did the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "docs"))  # make_demo_checkpoint's tokenizer

MAX_LENGTH = 2048
MODELS = ("tiny", "gemma3_270m")
VOCAB = 512
# The Llama of the tests' logit comparisons (3 layers, hidden 64, vocabulary 512).
TINY_LLAMA = dict(
    model_type="llama",
    num_hidden_layers=3,
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=128,
    ),
)


def write_checkpoint(name: str, directory: Path) -> Path:
    """The checkpoint `name` (random weights, seed 0, fp32) with a 512-token BPE tokenizer that
    starts each text with <bos>, in `directory`."""
    import torch
    from make_demo_checkpoint import train_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "tiny":
        spec = dict(TINY_LLAMA)
    else:
        spec = json.loads((REPO / "tests" / "hf_configs" / f"{name}.json").read_text())
    spec.update(bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    train_tokenizer(directory, VOCAB, bos=True)
    return directory


def loglikelihood_requests(count: int, seed: int = 0) -> list[tuple[None, list[int], list]]:
    rng = np.random.default_rng(seed)
    return [
        (
            None,
            rng.integers(3, 512, rng.integers(32, 225)).tolist(),
            rng.integers(3, 512, c).tolist(),
        )
        for c in rng.integers(1, 9, count)
    ]


def generation_requests(count: int, new_tokens: int) -> list[SimpleNamespace]:
    """`count` lines of a small Python file as prompts, no stop string."""
    lines = [
        line
        for i in range(count)
        for line in (
            f"def function_{i}(value):",
            f"    return value * {i} + len('meshtrain tokenizer test {i}')",
        )
    ][:count]
    return [
        SimpleNamespace(args=(line, {"until": [], "max_gen_toks": new_tokens})) for line in lines
    ]


def timed(function, *args):
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def best_of(repeats: int, function, *args):
    """The result and the shortest time of `repeats` calls: on a shared machine the other
    processes only ever slow a call down."""
    runs = [timed(function, *args) for _ in range(repeats)]
    return runs[0][0], min(seconds for _, seconds in runs)


def measure_meshtrain(
    checkpoint: Path, ll: list, prompts: list, batch_size: int, repeats: int
) -> dict:
    from meshtrain.harness.lm import MeshtrainLM

    lm = MeshtrainLM(checkpoint=str(checkpoint), max_length=MAX_LENGTH, generate_batch=batch_size)
    _, first_ll = timed(lm._loglikelihood_tokens, ll)
    scores, ll_s = best_of(repeats, lm._loglikelihood_tokens, ll)
    counted = []
    generate = lm.engine.generate
    lm.engine.generate = lambda batch: counted.extend(map(len, out := generate(batch))) or out
    _, first_gen = timed(lm.generate_until, prompts[:1])
    counted.clear()
    _, gen_s = best_of(repeats, lm.generate_until, prompts)
    return {
        "loglikelihood_requests_per_s": len(ll) / ll_s,
        "generation_tokens_per_s": sum(counted) / repeats / gen_s,
        "generated_tokens": sum(counted) // repeats,
        "first_call_s": {"loglikelihood": first_ll, "generate_one_prompt": first_gen},
        "scores": [s for s, _ in scores],
    }


def measure_hf(checkpoint: Path, ll: list, prompts: list, batch_size: int, repeats: int) -> dict:
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(
        pretrained=str(checkpoint),
        dtype="float32",
        device="cpu",
        batch_size=batch_size,
        max_length=MAX_LENGTH,
    )
    counted = []
    model_generate = lm._model_generate

    def counting(context, **kwargs):
        out = model_generate(context, **kwargs)  # [B, prompt + new], padded on the left
        counted.append(int((out[:, context.shape[1] :] != lm.tokenizer.pad_token_id).sum()))
        return out

    lm._model_generate = counting
    lm._loglikelihood_tokens(ll[:batch_size])  # warm-up
    scores, ll_s = best_of(repeats, lm._loglikelihood_tokens, ll)
    lm.generate_until(prompts[:1])
    numbers = {"loglikelihood_requests_per_s": len(ll) / ll_s, "scores": [s for s, _ in scores]}
    for size in sorted({batch_size, 1}):
        lm.batch_size_per_gpu = size
        counted.clear()
        _, gen_s = best_of(repeats, lm.generate_until, prompts)
        numbers[f"generation_tokens_per_s_batch_{size}"] = sum(counted) / repeats / gen_s
    return numbers


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", choices=MODELS, help="repeatable; default both")
    parser.add_argument("--requests", type=int, default=64, help="loglikelihood requests")
    parser.add_argument("--prompts", type=int, default=8, help="generate_until prompts")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls; the best counts")
    parser.add_argument("--json", action="store_true", help="one JSON object per model")
    args = parser.parse_args(argv)
    rows = []
    for name in args.model or MODELS:
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = write_checkpoint(name, Path(directory))
            ll = loglikelihood_requests(args.requests)
            prompts = generation_requests(args.prompts, args.new_tokens)
            load_before = os.getloadavg()[0]
            ours = measure_meshtrain(checkpoint, ll, prompts, args.hf_batch_size, args.repeats)
            theirs = measure_hf(checkpoint, ll, prompts, args.hf_batch_size, args.repeats)
        mine, reference = np.asarray(ours.pop("scores")), np.asarray(theirs.pop("scores"))
        row = {
            "model": name,
            "meshtrain": ours,
            "hf": theirs,
            "max_relative_difference": float(np.max(np.abs(mine - reference) / np.abs(reference))),
            "requests": args.requests,
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "hf_batch_size": args.hf_batch_size,
            "repeats": args.repeats,
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "machine": machine(),
            "date": time.strftime("%Y-%m-%d"),
        }
        rows.append(row)
        print(json.dumps(row) if args.json else _lines(row), flush=True)
    return 0


def _lines(row: dict) -> str:
    ours, theirs, b = row["meshtrain"], row["hf"], row["hf_batch_size"]
    return "\n".join(
        [
            f"{row['model']} ({row['machine']}); log-likelihoods agree to "
            f"{row['max_relative_difference']:.1e} (relative)",
            f"  loglikelihood requests/s: meshtrain {ours['loglikelihood_requests_per_s']:.1f}, "
            f"hf (batch {b}) {theirs['loglikelihood_requests_per_s']:.1f}",
            f"  generation tokens/s: meshtrain {ours['generation_tokens_per_s']:.1f}, hf batch 1 "
            f"{theirs['generation_tokens_per_s_batch_1']:.1f}, hf batch {b} "
            f"{theirs[f'generation_tokens_per_s_batch_{b}']:.1f}",
            f"  meshtrain's first calls (compiles): {ours['first_call_s']['loglikelihood']:.1f} s "
            f"loglikelihood, {ours['first_call_s']['generate_one_prompt']:.1f} s one generation",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
