"""A W&B offline run as its records: the run-<id>.wandb file read with wandb's own protobuf
messages (wandb.proto.wandb_internal_pb2.Record). wandb 0.19+ writes the file from its Go core
and ships no Python reader; the framing is LevelDB's log format, which `wandb sync` reads."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_HEADER = 7  # ":W&B", a 2-byte magic number and a version byte
_BLOCK = 32 * 1024  # records are cut into chunks that never cross a block's end
_CHUNK_HEADER = struct.Struct("<IHB")  # checksum, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    """The records' bytes, their chunks joined."""
    assert data[:4] == b":W&B", data[:16]
    payloads, pending, pos = [], b"", _HEADER
    while pos + _CHUNK_HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        chunk = data[pos + _CHUNK_HEADER.size : pos + _CHUNK_HEADER.size + length]
        pos += _CHUNK_HEADER.size + length
        if kind == 0 and length == 0:  # the unwritten rest of the last block
            break
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            payloads.append(pending)
    return payloads


def records(run_file: Path) -> list:
    """Every record of a run-<id>.wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    parsed = []
    for payload in _payloads(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        parsed.append(record)
    return parsed


def offline_run_file(run_dir: Path) -> Path:
    """The one offline run's run-<id>.wandb under <run_dir>/wandb/."""
    (found,) = Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")
    return found


def history(run_file: Path) -> dict[int, dict[str, float]]:
    """step → {metric: value} of every run.log of the run (W&B's own _step, _runtime and
    _timestamp left out)."""
    steps = {}
    for record in records(run_file):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        step = items.pop("_step")
        steps[step] = {k: v for k, v in items.items() if not k.startswith("_")}
    return steps


def run_record(run_file: Path):
    """The run's RunRecord: its name, project, tags and config."""
    for record in records(run_file):
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise AssertionError(f"{run_file} holds no run record")
