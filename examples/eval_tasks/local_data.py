"""The datasets of the task YAMLs beside this file, read from data/ next to it whatever the
working directory (lm-eval calls a task's `custom_dataset` with its dataset_kwargs and metadata).
Copy it with your own JSONL files to make tasks of them."""

import json
from pathlib import Path

import datasets

DATA = Path(__file__).resolve().parent / "data"


def jsonl(data_file: str, **_) -> datasets.DatasetDict:
    """data/<data_file>, one JSON object per line, as the split "test"."""
    lines = (DATA / data_file).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
