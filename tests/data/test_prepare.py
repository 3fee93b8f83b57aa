"""Tests of meshtrain.data.prepare: work units, worker-count independence, resume, refusal of a
foreign directory, bad-record counts and the command line."""

from __future__ import annotations

import gzip
import itertools
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.paths import REPO
from helpers.process import assert_one_line_error, run_python

from meshtrain.data import prepare as prepare_module
from meshtrain.data.prepare import plan_units, prepare
from meshtrain.data.shards import PreparedCorpus, document_draw
from meshtrain.data.sources import resolve_paths
from meshtrain.errors import DataError

UNIT = 200  # bytes per work unit in these tests: many units from a few kilobytes


def write_inputs(directory: Path) -> tuple[list[Path], Path]:
    """A big .jsonl (split), a .jsonl.gz, a parquet file of 4 row groups and 3 text files."""
    directory.mkdir(parents=True, exist_ok=True)
    records = [json.dumps({"text": f"record {i} " + "y" * (i % 13)}) for i in range(60)]
    (directory / "big.jsonl").write_text("\n".join(records) + "\n")
    with gzip.open(directory / "small.jsonl.gz", "wt") as f:
        f.write('{"text": "zipped one"}\n{"text": "zipped two"}\n')
    texts = [f"row {i} " + "z" * (40 + i) for i in range(8)]
    pq.write_table(pa.table({"text": texts}), directory / "rows.parquet", row_group_size=2)
    for name in ("t1.txt", "t2.txt", "t3.md"):
        (directory / "notes" / name).parent.mkdir(exist_ok=True)
        (directory / "notes" / name).write_text(f"the file {name}\n")
    return resolve_paths([str(directory)])


def directory_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_every_format_round_trips_with_record_keys(tmp_path):
    files, root = write_inputs(tmp_path / "in")
    corpus = prepare(files, tmp_path / "out", root=root, unit_bytes=UNIT)
    per_file = {f["path"]: (f["format"], f["documents"]) for f in corpus.manifest["files"]}
    assert per_file == {
        "big.jsonl": ("jsonl", 60),
        "notes/t1.txt": ("text", 1),
        "notes/t2.txt": ("text", 1),
        "notes/t3.md": ("text", 1),
        "rows.parquet": ("parquet", 8),
        "small.jsonl.gz": ("jsonl.gz", 2),
    }
    assert corpus.num_documents == 73 == corpus.manifest["documents"]
    first_parquet = 60 + 3
    text = corpus.read(first_parquet + 5, 0, int(corpus.lengths[first_parquet + 5]))
    assert bytes(text.astype("uint8")) == ("row 5 " + "z" * 45).encode()
    assert bytes(corpus.read(72, 0, 10).astype("uint8")) == b"zipped two"
    assert bytes(corpus.read(60, 0, 16).astype("uint8")) == b"the file t1.txt\n"
    assert corpus.draws[0] == document_draw("big.jsonl:1")
    assert corpus.draws[first_parquet + 5] == document_draw("rows.parquet:5")
    assert corpus.draws[60] == document_draw("notes/t1.txt")
    assert corpus.num_tokens == sum(f["tokens"] for f in corpus.manifest["files"])


def test_units_cut_big_files_and_group_small_ones(tmp_path):
    files, _ = write_inputs(tmp_path / "in")
    units = plan_units(files, UNIT)
    pieces = [u["pieces"] for u in units]
    big = [p for p in pieces if p[0][0] == 0]
    assert len(big) > 5 and all(len(p) == 1 and len(p[0]) == 4 for p in big)
    assert big[0][0][1:] == [0, big[0][0][2], 1]  # starts at byte 0, line 1
    parquet = [p[0] for p in pieces if p[0][0] == 4]
    assert len(parquet) > 1 and parquet[0][1] == 0 and parquet[-1][2] == 4  # 4 row groups
    assert all(a[2] == b[1] for a, b in itertools.pairwise(parquet))
    assert all(q[3] == 2 * q[1] for q in parquet)  # first row: 2 rows per group
    assert [[1], [2], [3]] in pieces  # the three small text files in one unit
    assert sum(u["bytes"] for u in units if u["pieces"][0][0] == 0) == files[0].stat().st_size
    assert plan_units(files, 1 << 30) == [
        {"pieces": [[i] for i in range(6)], "bytes": sum(f.stat().st_size for f in files)}
    ]


def test_three_workers_write_the_same_bytes_as_one(tmp_path):
    files, root = write_inputs(tmp_path / "in")
    one = prepare(files, tmp_path / "one", root=root, unit_bytes=UNIT, workers=1)
    three = prepare(files, tmp_path / "three", root=root, unit_bytes=UNIT, workers=3)
    assert len(one.manifest["units"]) > 10
    assert directory_bytes(tmp_path / "one") == directory_bytes(tmp_path / "three")
    assert three.num_tokens == one.num_tokens


def test_an_interrupted_run_resumes_without_redoing_units(tmp_path, monkeypatch):
    files, root = write_inputs(tmp_path / "in")
    prepare(files, tmp_path / "whole", root=root, unit_bytes=UNIT)
    out = tmp_path / "out"
    real = prepare_module._prepare_unit

    def interrupted(job):
        if job["index"] == 3:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(prepare_module, "_prepare_unit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(files, out, root=root, unit_bytes=UNIT)
    done = {p.name: p.stat().st_mtime_ns for p in out.glob("unit-0000[0-2].*")}
    assert len(done) == 9 and not (out / "manifest.json").exists()
    assert not list(out.glob("unit-00003.*"))
    (out / ".tmp-unit-00003.tokens.npy.123").write_bytes(b"partial")
    monkeypatch.setattr(prepare_module, "_prepare_unit", real)
    recomputed = []
    monkeypatch.setattr(
        prepare_module, "_prepare_unit", lambda job: recomputed.append(job["index"]) or real(job)
    )
    prepare(files, out, root=root, unit_bytes=UNIT)
    assert recomputed[0] == 3 and not {0, 1, 2} & set(recomputed)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("unit-0000[0-2].*")} == done
    assert directory_bytes(out) == directory_bytes(tmp_path / "whole")


def test_same_plan_is_already_prepared_and_another_plan_is_refused(tmp_path, capsys):
    files, root = write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    prepare(files, out, root=root, unit_bytes=UNIT)
    before = directory_bytes(out)
    assert prepare(files, out, root=root, unit_bytes=UNIT, progress=True).num_documents == 73
    assert capsys.readouterr().err == f"{out} is already prepared\n"
    message = (
        f"--out {out} holds files that are not this preparation's (other inputs, tokenizer or "
        "options); choose an empty directory (nothing there was changed)"
    )
    for change in ({"text_key": "body"}, {"on_bad_record": "skip"}, {"unit_bytes": 1000}):
        with pytest.raises(DataError) as info:
            prepare(files, out, root=root, **{"unit_bytes": UNIT, **change})
        assert str(info.value) == message
    with pytest.raises(DataError, match="holds files that are not this preparation"):
        prepare(files[:2], out, root=root, unit_bytes=UNIT)
    os.utime(files[0], ns=(1, 1))  # an edited input is another plan
    with pytest.raises(DataError, match="holds files that are not this preparation"):
        prepare(files, out, root=root, unit_bytes=UNIT)
    assert directory_bytes(out) == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="holds files that are not this preparation"):
        prepare(files, tmp_path / "other", root=root)
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["keep.txt"]


def test_skipped_records_are_counted_in_the_manifest(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "ok"}\nnot json\n{"id": 1}\n{"text": 5}\n')
    (tmp_path / "in" / "b.txt").write_bytes(b"\xff\xfe")
    files, root = resolve_paths([str(tmp_path / "in")])
    with pytest.raises(DataError, match=r"a\.jsonl:2: invalid JSON"):
        prepare(files, tmp_path / "strict", root=root)
    corpus = prepare(files, tmp_path / "out", root=root, on_bad_record="skip")
    assert corpus.num_documents == 1 and corpus.num_tokens == 2
    assert corpus.manifest["bad_records"] == {
        "invalid_json": 1,
        "missing_text_key": 1,
        "non_string_text": 1,
        "undecodable_bytes": 1,
    }
    assert PreparedCorpus(tmp_path / "out").bad_records.total == 4


def cli(*args: str | Path, cwd: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return run_python("-m", "meshtrain.data.prepare", *args, env=env, cwd=cwd, timeout=120)


def test_command_line_prepares_and_reports_bad_input(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n{"text": "world"}\n')
    result = cli("--out", "out", "--workers", "2", "a.jsonl", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "prepared out: 2 documents, 10 tokens, skipped no records in "
    )
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["tokens"] == 10
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n{"txt": "y"}\n')
    result = cli("--out", "out2", "b.jsonl", cwd=tmp_path)
    assert_one_line_error(
        result, "b.jsonl:2: no 'text' key (has keys ['txt']); set data.text_key=txt"
    )
    assert_one_line_error(
        cli("--out", "o", "missing/*.jsonl", cwd=tmp_path),
        "PATH: 'missing/*.jsonl' matches no file",
    )
    assert_one_line_error(
        cli("a.jsonl", cwd=tmp_path), "the following arguments are required: --out"
    )
    assert_one_line_error(
        cli("--out", "o", "--tokenizer", "nope.bin", "a.jsonl", cwd=tmp_path),
        "data.tokenizer='nope.bin' is not supported",
    )
