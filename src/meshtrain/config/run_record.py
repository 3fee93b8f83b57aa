"""The run directory's record of what ran (Hydra's `.hydra/`: config.yaml, hydra.yaml,
overrides.yaml), belonging to the run that holds the directory.

Hydra writes its record when a job starts, before meshtrain's checks; a second command on the
same hydra.run.dir (refused by the run lock, by a resume comparison or by a bad key) would
replace the record of the run there. So Hydra writes into a directory of this process's own,
`.hydra-pending-<pid>` (configs/config.yaml's output_subdir), and the record is moved into place
once the run is accepted (its lock held, its resume compared): `.hydra/` for the first start of
a run directory, `.hydra/starts/<date>_<time>/` for each resumed start after it, so the first
record is never overwritten. A refused command's pending record is removed.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

RECORD = ".hydra"
STARTS = "starts"  # inside RECORD: the records of the resumed starts


def pending_record_name(pid: int | None = None) -> str:
    """Where Hydra writes this process's record until the run is accepted."""
    return f"{RECORD}-pending-{os.getpid() if pid is None else pid}"


def keep_run_record(run_dir: Path) -> Path | None:
    """Moves this process's pending record into place (see the module docstring) and returns
    where it went; None when there is none (a run started without Hydra, or not process 0)."""
    pending = Path(run_dir) / pending_record_name()
    if not pending.is_dir():
        return None
    record = Path(run_dir) / RECORD
    if not record.exists():
        pending.rename(record)
        return record
    starts = record / STARTS
    starts.mkdir(exist_ok=True)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    target, suffix = starts / stamp, 1
    while target.exists():
        suffix += 1
        target = starts / f"{stamp}-{suffix}"
    pending.rename(target)
    return target


def discard_run_record(run_dir: Path) -> None:
    """Removes this process's pending record: the command was refused, the run directory's
    record stays that of the run it belongs to."""
    shutil.rmtree(Path(run_dir) / pending_record_name(), ignore_errors=True)
