"""docs/data.md's bad-input lines are what meshtrain prints for those inputs, word for word."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.config import compose_config
from helpers.paths import REPO

from meshtrain.config import DataConfig
from meshtrain.config.validate import check_config
from meshtrain.data import build_dataset
from meshtrain.errors import ConfigError, error_line

DOC = REPO / "docs" / "data.md"


def documented_errors() -> list[str]:
    section = DOC.read_text().split("## Bad input", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    return block.splitlines()


def write_inputs(root: Path) -> None:
    root.mkdir()
    (root / "empty").mkdir()
    (root / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "fine"\n')
    (root / "key.jsonl").write_text('{"content": "x", "id": 1}\n')
    (root / "number.jsonl").write_text('{"text": 5}\n')
    (root / "skipped.jsonl").write_text('not json\n{"other": 1}\n')
    pq.write_table(pa.table({"text": ["a", None]}), root / "null.parquet")
    pq.write_table(pa.table({"content": ["a"]}), root / "other.parquet")
    (root / "broken.parquet").write_bytes(b"not parquet")
    (root / "latin1.txt").write_bytes(b"caf\xe9\n")


def data_error(cfg: DataConfig) -> str:
    with pytest.raises(ConfigError) as err:
        build_dataset(cfg, split="train", vocab_size=384)
    return error_line(str(err.value))


def config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        check_config(compose_config(*overrides))
    return error_line(str(err.value))


def test_every_documented_bad_input_prints_its_line(tmp_path):
    root = tmp_path / "data"
    write_inputs(root)
    options = {"cache_dir": None, "validation_fraction": 0.0}

    def paths(*names: str, **changes) -> str:
        return data_error(DataConfig(paths=[str(root / n) for n in names], **options, **changes))

    printed = [
        paths("missing.jsonl"),
        paths("*.csv"),
        paths("empty"),
        *[paths(n) for n in ("bad.jsonl", "key.jsonl", "number.jsonl", "null.parquet")],
        *[paths(n) for n in ("other.parquet", "broken.parquet", "latin1.txt")],
        paths("skipped.jsonl", on_bad_record="skip"),
        config_error(
            "data.mixture=[{name:code,paths:[a],weight:0.7},{name:prose,paths:[b],weight:0}]"
        ),
        config_error("data=text"),
    ]
    printed = [line.replace(str(root), "/data") for line in printed]
    assert printed == documented_errors()
    assert all("\n" not in line for line in printed)


def test_skipping_keeps_the_good_records(tmp_path):
    root = tmp_path / "data"
    write_inputs(root)
    names = ["bad.jsonl", "key.jsonl", "number.jsonl", "null.parquet", "broken.parquet"]
    cfg = DataConfig(
        paths=[str(root / n) for n in names],
        on_bad_record="skip",
        cache_dir=None,
        validation_fraction=0.0,
        seq_len=4,
    )
    dataset = build_dataset(cfg, split="train", vocab_size=384)
    assert dataset.num_documents == 2  # "ok" and the parquet's "a"
