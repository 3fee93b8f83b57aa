"""Tokenises documents into a prepared directory (meshtrain.data.shards), in work units that
workers run in parallel and an interrupted run resumes.

    python -m meshtrain.data.prepare --out DIR [--tokenizer T] [--text-key K] [--workers N]
        [--on-bad-record error|skip] PATH...
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from meshtrain.data.bad_records import ON_BAD_RECORD, BadRecords
from meshtrain.data.chat.records import flagged_ids, record_keys
from meshtrain.data.parts import Part, split_jsonl, split_parquet
from meshtrain.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    PLAN,
    TEMP_PREFIX,
    PreparedCorpus,
    key_hash,
    read_json,
    token_dtype,
    tokenizer_identity,
    unit_name,
    write_json,
    write_unit,
)
from meshtrain.data.sources import (
    document_format,
    read_documents,
    read_records,
)
from meshtrain.data.tokenizer import Tokenizer, build_tokenizer
from meshtrain.errors import DataError

UNIT_BYTES = 32 << 20  # input bytes per work unit (files are grouped or cut to about this)
UNIT_FILES = 1024  # at most this many small files per work unit
ENCODE_CHARS = 4 << 20  # characters per encode_batch call: bounds a worker's memory
# The plan entries that must match for a rerun to resume (the root and the tokenizer's path may
# move; the units follow from the rest).
_PLAN_KEYS = ("version", "tokenizer", "text_key", "chat", "on_bad_record", "unit_bytes", "files")
# A unit's entry in the manifest: its counts, and what opening it checks (absent from a unit
# written before the checksums existed; meshtrain.data.integrity skips those checks for it).
_UNIT_KEYS = (
    "name",
    "documents",
    "tokens",
    "tokens_sha256",
    "tokens_sample_sha256",
    "docs_sha256",
    "max_token_id",
)


def plan_units(files: Sequence[Path], unit_bytes: int) -> list[dict[str, Any]]:
    """Cuts the files into work units, in file order and independent of the worker count.

    A unit is {"pieces": [...], "bytes": input bytes}; a piece is [file index] for a whole file,
    or [file index, start, stop, first record] for a Part (a byte range of a big .jsonl, row
    groups of a big parquet file). Consecutive whole files are grouped until `unit_bytes` or
    UNIT_FILES.
    """
    units: list[dict[str, Any]] = []
    group: list[list[int]] = []
    size = 0
    for index, path in enumerate(files):
        nbytes, fmt = path.stat().st_size, document_format(path)
        parts = None
        if nbytes > unit_bytes and fmt == "jsonl":
            parts = split_jsonl(path, unit_bytes)
        elif nbytes > unit_bytes and fmt == "parquet":
            parts = split_parquet(path, unit_bytes)
        if parts and len(parts) > 1:
            if group:
                units.append({"pieces": group, "bytes": size})
                group, size = [], 0
            shares = [p.stop - p.start if fmt == "jsonl" else nbytes // len(parts) for p in parts]
            units += [
                {"pieces": [[index, p.start, p.stop, p.first_record]], "bytes": share}
                for p, share in zip(parts, shares, strict=True)
            ]
            continue
        group.append([index])
        size += nbytes
        if size >= unit_bytes or len(group) >= UNIT_FILES:
            units.append({"pieces": group, "bytes": size})
            group, size = [], 0
    if group:
        units.append({"pieces": group, "bytes": size})
    return units


_TOKENIZERS: dict[str, Tokenizer] = {}  # one per worker process, built on its first unit


def _prepare_unit(job: dict[str, Any]) -> dict[str, Any]:
    """Reads, tokenises and writes one work unit; returns its stats (also its .json marker).

    Runs in a spawned worker or in-process: everything it needs is in `job`.
    """
    if job["tokenizer"] not in _TOKENIZERS:
        _TOKENIZERS[job["tokenizer"]] = build_tokenizer(job["tokenizer"])
    tokenizer = _TOKENIZERS[job["tokenizer"]]
    dtype = np.dtype(job["dtype"])  # ids narrowed at once: a unit's int32 ids would be 2x
    bad, tokens, hashes, texts, chars = BadRecords(), [], [], [], 0
    pieces = []  # [file index, documents]
    for piece in job["pieces"]:
        path, relpath = Path(job["paths"][piece[0]]), job["relpaths"][piece[0]]
        part = Part(*piece[1:]) if len(piece) > 1 else None
        keyed = document_format(path) != "text"
        if job["chat"] is not None:  # conversations: encoded (and marked) one by one
            convert = flagged_ids(job["tokenizer"], job["chat"])
            keys, policy = record_keys(job["chat"]), job["on_bad_record"]
            count = len(tokens)
            for number, ids in read_records(
                path, convert, keys=keys, on_bad_record=policy, bad=bad, part=part
            ):
                hashes.append(key_hash(f"{relpath}:{number}"))
                tokens.append(ids)
            pieces.append([piece[0], len(tokens) - count])
            continue
        documents = read_documents(
            path, text_key=job["text_key"], on_bad_record=job["on_bad_record"], bad=bad, part=part
        )
        count = 0
        for number, text in documents:
            hashes.append(key_hash(f"{relpath}:{number}" if keyed else relpath))
            texts.append(text)
            chars, count = chars + len(text), count + 1
            if chars >= ENCODE_CHARS:
                tokens += [t.astype(dtype) for t in tokenizer.encode_batch(texts)]
                texts, chars = [], 0
        pieces.append([piece[0], count])
    if texts:
        tokens += [t.astype(dtype) for t in tokenizer.encode_batch(texts)]
    files, first = [], 0
    for index, count in pieces:
        files.append([index, count, sum(len(t) for t in tokens[first : first + count])])
        first += count
    stats = {
        "name": unit_name(job["index"]),
        "documents": len(tokens),
        "tokens": sum(len(t) for t in tokens),
        "files": files,  # [file index, documents, tokens] per piece
        "bad_records": bad.counts,
    }
    return write_unit(Path(job["out"]), job["index"], tokens, hashes, dtype, stats)


def _refuse(out: Path) -> DataError:
    return DataError(
        f"--out {out} holds files that are not this preparation's (other inputs, tokenizer or "
        "options); choose an empty directory (nothing there was changed)"
    )


def _open_plan(out: Path, head: dict[str, Any], files: Sequence[Path]) -> dict[str, Any]:
    """The plan of `out`: the one already there if it matches `head`, else a new one written
    first into an empty `out`. Refuses a directory holding anything else."""
    if (out / PLAN).is_file():
        plan = read_json(out / PLAN)
        if all(plan.get(k) == head[k] for k in _PLAN_KEYS):
            return plan
        raise _refuse(out)
    if out.exists() and any(out.iterdir()):
        raise _refuse(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = {**head, "units": plan_units(files, head["unit_bytes"])}
    write_json(out / PLAN, plan)
    return plan


def _write_manifest(out: Path, plan: dict[str, Any]) -> None:
    """Sums the units' stats per file and overall into manifest.json, written last."""
    units = [read_json(out / f"{unit_name(i)}.json") for i in range(len(plan["units"]))]
    files = [{**f, "documents": 0, "tokens": 0} for f in plan["files"]]
    bad = BadRecords()
    for unit in units:
        bad.merge(BadRecords(unit["bad_records"]))
        for index, documents, tokens in unit["files"]:
            files[index]["documents"] += documents
            files[index]["tokens"] += tokens
    manifest = {
        **{k: v for k, v in plan.items() if k != "units"},
        "files": files,
        "documents": sum(u["documents"] for u in units),
        "tokens": sum(u["tokens"] for u in units),
        "bad_records": bad.counts,
        "units": [{k: u[k] for k in _UNIT_KEYS if k in u} for u in units],
    }
    write_json(out / MANIFEST, manifest)


def _progress_bar(enabled: bool, total: int) -> Progress | nullcontext:
    if not enabled:
        return nullcontext()
    console = Console(stderr=True)
    columns = (TextColumn("preparing"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    bar = Progress(
        *columns,
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,  # a log file gets the summary line only
    )
    bar.add_task("preparing", total=total)
    return bar


def _run_units(jobs: list[dict[str, Any]], workers: int, bar: Progress | None) -> None:
    """Runs the jobs in unit order: in-process for one worker, else a spawn pool (never fork:
    the parent may hold JAX or tokenizer threads)."""
    if workers == 1 or len(jobs) <= 1:
        results = map(_prepare_unit, jobs)
        pool = nullcontext()
    else:
        pool = multiprocessing.get_context("spawn").Pool(min(workers, len(jobs)))
        results = pool.imap(_prepare_unit, jobs)
    with pool:
        for job, _ in zip(jobs, results, strict=True):
            if bar is not None:
                bar.advance(bar.task_ids[0], job["bytes"])


def prepare(
    files: Sequence[Path],
    out: Path,
    *,
    root: Path,
    tokenizer: str = "byte",
    text_key: str = "text",
    chat: dict[str, Any] | None = None,
    on_bad_record: str = "error",
    workers: int = 1,
    progress: bool = False,
    unit_bytes: int = UNIT_BYTES,
) -> PreparedCorpus:
    """Tokenises the documents of `files` into the prepared directory `out` and opens it; with
    `chat` (meshtrain.data.chat.records.chat_options), their conversations, marked for the loss.

    Resumes an interrupted run with the same plan; a complete `out` is opened as it is.
    `progress` shows a bar over input bytes (on a terminal) and prints a summary line.
    """
    if on_bad_record not in ON_BAD_RECORD:
        raise DataError(f"--on-bad-record {on_bad_record!r} is not supported; use error or skip")
    if workers < 1:
        raise DataError(f"--workers {workers} must be at least 1")
    started, out, root = time.perf_counter(), Path(out), Path(root)
    files = sorted(Path(f).absolute() for f in files)
    outside = [f for f in files if not f.is_relative_to(root)]
    if outside:
        raise DataError(f"{outside[0]} is not under the root {root}; pass a common parent")
    identity = tokenizer_identity(tokenizer)
    stats = [f.stat() for f in files]
    head = {
        "version": FORMAT_VERSION,
        "tokenizer": identity,
        "tokenizer_name": tokenizer,
        "text_key": text_key,
        "chat": chat,
        "on_bad_record": on_bad_record,
        "unit_bytes": unit_bytes,
        "root": str(root),
        # chat ids carry the NOT_TRAINED mark in bit 30
        "token_dtype": "uint32" if chat else token_dtype(identity["vocab_size"]).name,
        "files": [
            {
                "path": f.relative_to(root).as_posix(),
                "size": s.st_size,
                "mtime_ns": s.st_mtime_ns,
                "format": document_format(f),
            }
            for f, s in zip(files, stats, strict=True)
        ],
    }
    plan = _open_plan(out, head, files)
    if (out / MANIFEST).is_file():
        if progress:
            print(f"{out} is already prepared", file=sys.stderr)
        return PreparedCorpus(out)
    for temp in out.glob(f"{TEMP_PREFIX}*"):  # partial writes of an interrupted run
        temp.unlink()
    common = {
        "out": str(out),
        "paths": [str(f) for f in files],
        "relpaths": [f["path"] for f in plan["files"]],
        "tokenizer": tokenizer,
        "text_key": text_key,
        "chat": chat,
        "on_bad_record": on_bad_record,
        "dtype": plan["token_dtype"],
    }
    jobs = [
        {**common, "index": i, **unit}
        for i, unit in enumerate(plan["units"])
        if not (out / f"{unit_name(i)}.json").is_file()
    ]
    total = sum(unit["bytes"] for unit in plan["units"])
    with _progress_bar(progress, total) as bar:
        if bar is not None:
            bar.advance(bar.task_ids[0], total - sum(j["bytes"] for j in jobs))
        _run_units(jobs, workers, bar)
    _write_manifest(out, plan)
    corpus = PreparedCorpus(out)
    if progress:
        print(summary_line(corpus, time.perf_counter() - started), file=sys.stderr)
    return corpus


def summary_line(corpus: PreparedCorpus, seconds: float) -> str:
    """e.g. "prepared out: 1,812 documents, 31,004,211 tokens, skipped no records in 2.1 s
    (14,763,910 tokens/s)"."""
    rate = corpus.num_tokens / max(seconds, 1e-9)
    return (
        f"prepared {corpus.directory}: {corpus.num_documents:,} documents, "
        f"{corpus.num_tokens:,} tokens, {corpus.bad_records.describe()} in {seconds:.1f} s "
        f"({rate:,.0f} tokens/s)"
    )


if __name__ == "__main__":  # python -m meshtrain.data.prepare runs cli/prepare.py's command
    from meshtrain.cli.prepare import main

    main()
