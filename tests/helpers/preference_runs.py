"""Tiny DPO runs on pairs of sums (tests/train/test_preference.py, test_reference_scores.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from helpers.paths import REPO

TOKENIZER = REPO / "tests" / "fixtures" / "chat" / "qwen3"


def pairs_file(tmp_path: Path, count: int = 24) -> Path:
    """`count` pairs of sums in trl's conversational preference format: the chosen answer is
    right, the rejected one off by 1 or 2."""
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(count):
        a, b = rng.integers(1, 50, 2)
        wrong = a + b + rng.choice([-2, -1, 1, 2])
        lines.append(
            {
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "chosen": [{"role": "assistant", "content": str(a + b)}],
                "rejected": [{"role": "assistant", "content": str(wrong)}],
            }
        )
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def dpo_overrides(pairs: Path) -> tuple[str, ...]:
    """A tiny DPO run on `pairs` (3 steps, no checkpoint unless overridden)."""
    return (
        "data=preference",
        "objective=dpo",
        f"data.paths=[{pairs}]",
        f"data.tokenizer={TOKENIZER}",
        "model.vocab_size=512",
        "model.num_layers=1",
        "data.seq_len=64",
        "data.validation_fraction=0",
        "training.global_batch_size=8",
        "training.steps=3",
        "training.log_every=1",
        "training.warmup_steps=1",
        "training.eval_every=0",
        "checkpoint.every_steps=0",
        "training.adam_eps=1e-3",
    )
