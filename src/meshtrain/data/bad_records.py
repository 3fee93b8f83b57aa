"""Bad records: the faults a record can have, and their count where data.on_bad_record=skip
skips them (one DataError line where it is error, the default)."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshtrain.errors import DataError

ON_BAD_RECORD = ("error", "skip")
BAD_RECORD_KINDS = (
    "invalid_json",
    "missing_text_key",
    "non_string_text",
    "undecodable_bytes",
    "lone_surrogate",
    "unreadable_parquet",
    "bad_chat_record",
)
SKIP_HINT = "set data.on_bad_record=skip (prepare: --on-bad-record skip) to skip it"


@dataclass
class BadRecords:
    """Counts of skipped record-level faults, by kind (BAD_RECORD_KINDS)."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int = 1) -> None:
        if n:
            self.counts[kind] = self.counts.get(kind, 0) + n

    def merge(self, other: BadRecords) -> None:
        for kind, n in other.counts.items():
            self.add(kind, n)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        """e.g. "skipped 3 records: 2 invalid_json, 1 undecodable_bytes"."""
        if not self.total:
            return "skipped no records"
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items()) if n)
        return f"skipped {self.total} record{'s' * (self.total != 1)}: {kinds}"


def fault(kind: str, message: str, on_bad_record: str, bad: BadRecords) -> None:
    """Raises the one-line `message` (on_bad_record=error) or counts the fault in `bad`."""
    if on_bad_record == "error":
        raise DataError(message)
    bad.add(kind)
