"""Work units cut from big files: byte ranges of a .jsonl, row-group ranges of a parquet file,
each read on its own (meshtrain.data.prepare tokenises them in parallel)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Part:
    """A slice of one file: bytes [start, stop) of an uncompressed .jsonl, cut at line starts,
    whose first line is line `first_record` (1-based); or row groups [start, stop) of a parquet
    file whose first row is row `first_record` (0-based)."""

    start: int
    stop: int
    first_record: int


def split_jsonl(path: Path, unit_bytes: int) -> list[Part]:
    """Cuts an uncompressed .jsonl into byte ranges of about `unit_bytes`, each ending at a line
    end, with the line number each starts at (one pass over the file, counting newlines)."""
    size, parts = path.stat().st_size, []
    with open(path, "rb") as f:
        start, line = 0, 1
        while start < size:
            newlines, remaining = 0, unit_bytes
            while remaining > 0 and (chunk := f.read(min(remaining, 1 << 20))):
                newlines, remaining = newlines + chunk.count(b"\n"), remaining - len(chunk)
            newlines += f.readline().count(b"\n")  # finish the line the cut fell in
            parts.append(Part(start, f.tell(), line))
            start, line = f.tell(), line + newlines
    return parts


def split_parquet(path: Path, unit_bytes: int) -> list[Part] | None:
    """Cuts a parquet file into ranges of row groups of about `unit_bytes` (compressed), or None
    if its footer cannot be read (the reader then reports the file)."""
    import pyarrow as pa  # here: a run without parquet files never loads it
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except (pa.ArrowInvalid, OSError):
        return None
    parts, start, first_row, row, size = [], 0, 0, 0, 0
    for group in range(meta.num_row_groups):
        rg = meta.row_group(group)
        size += sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
        row += rg.num_rows
        if size >= unit_bytes or group == meta.num_row_groups - 1:
            parts.append(Part(start, group + 1, first_row))
            start, first_row, size = group + 1, row, 0
    return parts
