"""Memory stays flat on prepared shards far larger than what a run reads: only the tokens of
the windows read are read, into buffers that are freed with their batch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers.process import subprocess_env

from meshtrain.data.prepare import prepare

READER = """
import json, sys
from meshtrain.config import DataConfig
from meshtrain.data import BatchIterator, build_dataset

def rss_mib():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) / 1024

cfg = DataConfig(source="prepared", path=sys.argv[1], seq_len=256, validation_fraction=0.0)
dataset = build_dataset(cfg, split="train", vocab_size=259)
batches = BatchIterator(dataset, global_batch=16, accum_steps=1, rows=slice(0, 16), seed=0)
next(batches)
before = rss_mib()
for _ in range(100):
    next(batches)
print(json.dumps({"before": before, "after": rss_mib(), "sequences": len(dataset)}))
"""


@pytest.mark.slow
def test_reading_batches_of_a_large_prepared_corpus_keeps_memory_flat(tmp_path):
    # 160 MB of text in 4,000 documents: 320 MB of uint16 tokens on disk.
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     \n", np.uint8)
    with (tmp_path / "big.jsonl").open("w") as f:
        for _ in range(4_000):
            text = letters[rng.integers(0, len(letters), 40_000)].tobytes().decode()
            f.write(json.dumps({"text": text}) + "\n")
    corpus = prepare([tmp_path / "big.jsonl"], tmp_path / "prepared", root=tmp_path)
    token_bytes = sum(f.stat().st_size for f in (tmp_path / "prepared").glob("*.tokens.npy"))
    assert corpus.num_tokens == 160_000_000 and token_bytes > 300 * 2**20
    result = subprocess.run(
        [sys.executable, "-c", READER, str(tmp_path / "prepared")],
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["sequences"] == -(-(160_000_000 + 2 * 4_000) // 257)
    # 100 batches of 16 × 257 tokens read 1,600 windows (0.8 MB of tokens), not the 320 MB on
    # disk, nor the 640 MB an int32 copy of the corpus would take, nor the pages a memory map
    # keeps resident (it grew by 273 MiB here).
    assert report["after"] - report["before"] < 16, report
