"""Units and their formatting: bytes (GiB), FLOPs and durations, as every log line writes them."""

from __future__ import annotations

GIB, MIB, KIB = 1024**3, 1024**2, 1024


def format_bytes(value: float) -> str:
    """3.5 × 2³⁰ → "3.50 GiB"; below 1 KiB: "812 B"."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def format_flops(value: float, per: str = "") -> str:
    """1.23e15 → "1.23 PFLOP" (with per="/s": "1.23 PFLOP/s")."""
    for unit, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}FLOP{per}"
    return f"{value:.0f} FLOP{per}"


def format_eta(seconds: float) -> str:
    """Format a duration as "45s", "1m23s" or "2h03m"."""
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
