"""Units as the log lines write them: FLOPs and durations."""

import pytest

from meshtrain.units import format_eta, format_flops


def test_format_flops():
    assert format_flops(1.234e15) == "1.23 PFLOP"
    assert format_flops(2.5e12, "/s") == "2.50 TFLOP/s"
    assert format_flops(999) == "999 FLOP"


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0, "0s"),
        (45, "45s"),
        (45.4, "45s"),
        (59.6, "1m00s"),
        (83, "1m23s"),
        (3599, "59m59s"),
        (3600, "1h00m"),
        (7380, "2h03m"),
        (90061, "25h01m"),
    ],
)
def test_format_eta(seconds: float, expected: str) -> None:
    assert format_eta(seconds) == expected
