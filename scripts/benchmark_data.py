"""Data pipeline speed: tokenising raw jsonl with a BPE tokenizer, reading prepared shards, and
how long W1's training loop waits for its batches.

    python scripts/benchmark_data.py [--corpus-mb 64] [--quick] [--json] [--work-dir DIR]

Nothing is downloaded. A corpus of synthetic English-like documents (words of a fixed
vocabulary drawn with Zipf-like frequencies by a seeded numpy generator) is written as one
.jsonl, and a byte-level BPE tokenizer.json (<pad>, <bos>, <eos>, and a tokenizer_config.json
naming them) is trained on its first megabytes with the `tokenizers` library. Then:

tokenise  meshtrain.data.prepare of the .jsonl: in-process with workers=1, then the command line
          with --workers 2 (a subprocess, start-up included): input MB/s and tokens/s (document
          tokens, the manifest's count). The Rust tokenizer encodes each batch on every core
          either way, so workers=1 is not one core.
read      BatchIterator (workers=0, the read alone) over the train split of the prepared
          directory at seq_len 256: rows = the whole global batch (one process), then each half
          (two processes): sequences/s and tokens/s (seq_len tokens a sequence) per process and
          seconds per step, the median of --repeats. Document masking is computed on the device,
          so it costs nothing here.
W1 feed   run_training.py with scripts/benchmark.py's W1 overrides, but data=prepared on that
          directory and its tokenizer (model.vocab_size stays 32000, which holds the BPE
          vocabulary), logging every step without evaluation; from metrics.jsonl the median
          data_wait_s and step_time_s of the steps after the first (it compiles) and before the
          last (it reads nothing ahead), and their ratio. The target is under 0.05.

--json prints one JSON object on stdout (progress goes to stderr). --work-dir keeps the corpus,
tokenizer, prepared directories and the run there (default: a temporary directory, removed).
docs/data.md records the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from bench.corpus import (  # noqa: E402,F401  (the tests read them here)
    SPECIALS,
    corpus_texts,
    documents,
    train_tokenizer,
    word_list,
    write_corpus,
)
from benchmark import OVERRIDES, child_env, progress, stamp  # noqa: E402

SEQ_LEN = 256  # W1's sequence length
MODEL_VOCAB = 32000  # W1's model.vocab_size
W1_TARGET = 0.05  # the bound on data_wait_s / step_time_s
MB = 10**6


# ---------------------------------------------------------------------------------------------
# Tokenise: raw jsonl → prepared shards.


def rates(seconds: float, input_bytes: int, tokens: int) -> dict[str, float]:
    return {
        "seconds": seconds,
        "input_mb_per_sec": input_bytes / MB / seconds,
        "tokens_per_sec": tokens / seconds,
    }


def tokenise_in_process(corpus: Path, out: Path, tokenizer: Path) -> dict[str, Any]:
    """meshtrain.data.prepare.prepare with workers=1, timed; returns its rates and tokens."""
    from meshtrain.data.prepare import prepare

    start = time.perf_counter()
    prepared = prepare([corpus], out, root=corpus.parent, tokenizer=str(tokenizer), workers=1)
    seconds = time.perf_counter() - start
    return {
        **rates(seconds, corpus.stat().st_size, prepared.num_tokens),
        "tokens": prepared.num_tokens,
        "documents": prepared.num_documents,
    }


def tokenise_cli(corpus: Path, out: Path, tokenizer: Path, workers: int) -> dict[str, Any]:
    """`python -m meshtrain.data.prepare --workers N`, timed from launch to exit."""
    from meshtrain.data.shards import PreparedCorpus

    command = [sys.executable, "-m", "meshtrain.data.prepare", "--out", str(out)]
    command += ["--tokenizer", str(tokenizer), "--workers", str(workers), str(corpus)]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"benchmark_data: prepare failed:\n{proc.stderr[-3000:]}")
    prepared = PreparedCorpus(out)
    return {
        **rates(seconds, corpus.stat().st_size, prepared.num_tokens),
        "tokens": prepared.num_tokens,
        "documents": prepared.num_documents,
    }


# ---------------------------------------------------------------------------------------------
# Read: prepared shards → batches of one process.


def train_split(prepared: Path, tokenizer: Path):
    """The training split of `prepared` as a run with data=prepared at seq_len 256 reads it."""
    from meshtrain.config import DataConfig
    from meshtrain.data.pipeline import build_dataset

    cfg = DataConfig(
        source="prepared", path=str(prepared), tokenizer=str(tokenizer), seq_len=SEQ_LEN
    )
    return build_dataset(cfg, split="train", vocab_size=MODEL_VOCAB)


def read_rate(
    dataset, global_batch: int, rows: slice, steps: int, repeats: int
) -> dict[str, float]:
    """Median seconds per step of reading `rows` of each global batch (BatchIterator, no
    read-ahead) over `repeats` runs of `steps` consecutive steps, after one untimed step."""
    from meshtrain.data.batches import BatchIterator

    batches = BatchIterator(dataset, global_batch=global_batch, accum_steps=1, rows=rows, seed=0)
    shape = next(batches).shape  # [1, rows, seq_len + 1]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            next(batches)
        times.append((time.perf_counter() - start) / steps)
    step_s = statistics.median(times)
    return {
        "rows": int(shape[1]),
        "step_s": step_s,
        "sequences_per_sec": shape[1] / step_s,
        "tokens_per_sec": shape[1] * SEQ_LEN / step_s,
    }


def measure_reads(
    prepared: Path, tokenizer: Path, global_batch: int, steps: int, repeats: int
) -> dict[str, Any]:
    """Per-process read rates for 1 process (all rows) and 2 processes (each half, both
    measured, averaged)."""
    dataset = train_split(prepared, tokenizer)
    half = global_batch // 2
    one = read_rate(dataset, global_batch, slice(0, global_batch), steps, repeats)
    halves = [
        read_rate(dataset, global_batch, rows, steps, repeats)
        for rows in (slice(0, half), slice(half, global_batch))
    ]
    two = {key: statistics.mean(h[key] for h in halves) for key in one}
    two["rows"] = halves[0]["rows"]
    return {"1": one, "2": two, "sequences": len(dataset)}


# ---------------------------------------------------------------------------------------------
# W1 feed: the real training loop on the prepared directory.


def w1_overrides(prepared: Path, tokenizer: Path, run_dir: Path, steps: int) -> list[str]:
    """scripts/benchmark.py's W1 with data=prepared on `prepared`, every step logged, no eval."""
    overrides = [o for o in OVERRIDES["W1"] if o != "data=synthetic"]
    return [
        *overrides,
        "data=prepared",
        f"data.path={prepared}",
        f"data.tokenizer={tokenizer}",
        f"training.steps={steps}",
        "training.log_every=1",
        "training.eval_every=0",
        "checkpoint.every_steps=0",
        f"hydra.run.dir={run_dir}",
    ]


def w1_env(cache_root: Path) -> dict[str, str]:
    """benchmark.py's W1 child environment (one CPU device), meshtrain's caches in
    `cache_root`, and the caller's JAX compilation cache settings (the compile is not timed)."""
    env = child_env("W1")
    if "JAX_ENABLE_COMPILATION_CACHE" in os.environ:
        env["JAX_ENABLE_COMPILATION_CACHE"] = os.environ["JAX_ENABLE_COMPILATION_CACHE"]
    else:
        env.pop("JAX_ENABLE_COMPILATION_CACHE")
    env["MESHTRAIN_CACHE_DIR"] = str(cache_root)
    return env


def run_w1(prepared: Path, tokenizer: Path, work: Path, steps: int) -> list[dict[str, float]]:
    """Trains W1 on `prepared` for `steps` steps; returns its metrics.jsonl records."""
    run_dir = work / "w1-run"
    command = [
        sys.executable,
        "run_training.py",
        *w1_overrides(prepared, tokenizer, run_dir, steps),
    ]
    proc = subprocess.run(
        command, cwd=REPO, env=w1_env(work / "cache"), capture_output=True, text=True
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"benchmark_data: the W1 run failed (exit {proc.returncode}):\n{tail}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def feed_summary(records: list[dict[str, float]]) -> dict[str, Any]:
    """Median data_wait_s and step_time_s of the steps between the first and the last."""
    steady = [r for r in records if 1 < r["step"] < records[-1]["step"]]
    wait = statistics.median(r["data_wait_s"] for r in steady)
    step = statistics.median(r["step_time_s"] for r in steady)
    return {
        "w1_steps": int(records[-1]["step"]),
        "w1_steps_measured": len(steady),
        "w1_data_wait_s": wait,
        "w1_step_time_s": step,
        "w1_data_wait_fraction": wait / step,
        "w1_target_fraction": W1_TARGET,
        "w1_within_target": wait / step < W1_TARGET,
    }


# ---------------------------------------------------------------------------------------------
# The whole benchmark.


def sizes(args: argparse.Namespace) -> dict[str, int]:
    """The corpus, tokenizer and measurement sizes of a full or --quick run."""
    if args.quick:
        return {"mb": 2, "sample_mb": 1, "vocab": 1024, "batch": 16, "steps": 10, "w1": 6}
    return {"mb": args.corpus_mb, "sample_mb": 8, "vocab": 8192, "batch": 64, "steps": 25, "w1": 30}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every measurement, in `work`."""
    from meshtrain.config import DataConfig
    from meshtrain.data.tokenizer import build_tokenizer

    size = sizes(args)
    progress(f"writing a {size['mb']} MB corpus")
    corpus = work / "corpus" / "corpus.jsonl"
    corpus.parent.mkdir(parents=True)
    corpus_bytes, corpus_documents = write_corpus(corpus, size["mb"] * MB)
    progress(f"training a BPE tokenizer of {size['vocab']} tokens")
    tokenizer = train_tokenizer(work / "tokenizer", corpus, size["sample_mb"] * MB, size["vocab"])
    progress("tokenising in-process, workers=1")
    one = tokenise_in_process(corpus, work / "prepared", tokenizer)
    progress("tokenising with the command line, --workers 2")
    two = tokenise_cli(corpus, work / "prepared-cli", tokenizer, workers=2)
    progress("reading prepared shards")
    reads = measure_reads(work / "prepared", tokenizer, size["batch"], size["steps"], args.repeats)
    progress(f"training W1 on the prepared shards for {size['w1']} steps")
    records = run_w1(work / "prepared", tokenizer, work, size["w1"])
    return {
        "corpus_mb": corpus_bytes / MB,
        "corpus_bytes": corpus_bytes,
        "documents": corpus_documents,
        "tokens": one["tokens"],
        "tokens_cli": two["tokens"],
        "bpe_vocab_size": build_tokenizer(str(tokenizer)).vocab_size,
        "tokenise_seconds": {"1": one["seconds"], "2": two["seconds"]},
        "tokenise_input_mb_per_sec": {"1": one["input_mb_per_sec"], "2": two["input_mb_per_sec"]},
        "tokenise_tokens_per_sec": {"1": one["tokens_per_sec"], "2": two["tokens_per_sec"]},
        "read_global_batch": size["batch"],
        "read_seq_len": SEQ_LEN,
        "read_train_sequences": reads["sequences"],
        "read_rows_per_process": {p: reads[p]["rows"] for p in ("1", "2")},
        "read_step_s_per_process": {p: reads[p]["step_s"] for p in ("1", "2")},
        "read_sequences_per_sec_per_process": {
            p: reads[p]["sequences_per_sec"] for p in ("1", "2")
        },
        "read_tokens_per_sec_per_process": {p: reads[p]["tokens_per_sec"] for p in ("1", "2")},
        **feed_summary(records),
        "w1_data_workers": DataConfig().workers,  # the default W1 runs with
    }


def describe(result: dict[str, Any]) -> list[str]:
    """The result as lines for a person."""
    tok, read = result["tokenise_tokens_per_sec"], result["read_tokens_per_sec_per_process"]
    mbs, step = result["tokenise_input_mb_per_sec"], result["read_step_s_per_process"]
    rows = result["read_rows_per_process"]
    verdict = "within" if result["w1_within_target"] else "OVER"
    return [
        f"corpus: {result['corpus_mb']:.1f} MB jsonl, {result['documents']:,} documents, "
        f"{result['tokens']:,} BPE tokens (vocabulary {result['bpe_vocab_size']})",
        f"tokenise, in-process workers=1: {mbs['1']:.2f} MB/s, {tok['1']:,.0f} tokens/s",
        f"tokenise, CLI --workers 2:      {mbs['2']:.2f} MB/s, {tok['2']:,.0f} tokens/s",
        f"read, 1 process ({rows['1']} rows):  {tok_line(read['1'], step['1'])}",
        f"read, 2 processes ({rows['2']} rows): {tok_line(read['2'], step['2'])}",
        f"W1 feed: data_wait {result['w1_data_wait_s'] * 1e3:.2f} ms of a "
        f"{result['w1_step_time_s'] * 1e3:.1f} ms step = "
        f"{result['w1_data_wait_fraction']:.2%} ({verdict} the {W1_TARGET:.0%} target; median "
        f"of {result['w1_steps_measured']} steps)",
    ]


def tok_line(tokens_per_sec: float, step_s: float) -> str:
    return f"{tokens_per_sec:,.0f} tokens/s per process, {step_s * 1e3:.2f} ms a step"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus-mb", type=int, default=64, help="corpus size in MB (64)")
    parser.add_argument("--quick", action="store_true", help="a 2 MB corpus, few steps")
    parser.add_argument("--repeats", type=int, default=5, help="timed read runs (5)")
    parser.add_argument("--work-dir", type=Path, help="keep everything here (an empty directory)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        result = run(args, args.work_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="meshtrain-benchmark-data-") as tmp:
            result = run(args, Path(tmp))
    result = {**result, "seconds": time.perf_counter() - start}
    result = stamp(result, sys.argv[1:] if argv is None else list(argv), "benchmark_data.py")
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(describe(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
