"""The measured pipeline bubble (observe.bubble): tick times from the hand-overs' end times,
in the loop's order or its transpose's, and device numbers from the trace's names."""

import pytest

from meshtrain.observe.bubble import _tick_times, device_ordinal


def test_each_tick_lasts_until_its_hand_over_and_the_first_is_the_median():
    ends = [10.0, 17.0, 27.0, 33.0]  # gaps 7, 10, 6: median 7
    assert _tick_times(ends, 4, transposed=False) == [(0, 7.0), (1, 7.0), (2, 10.0), (3, 6.0)]


def test_a_transposed_loop_runs_its_ticks_last_first():
    assert _tick_times([0.0, 4.0, 10.0], 3, transposed=True) == [(2, 5.0), (1, 4.0), (0, 6.0)]


@pytest.mark.parametrize(
    ("name", "ordinal"), [("device 3", 3), ("/device:GPU:7", 7), ("/host:CPU", None)]
)
def test_devices_are_numbered_as_the_trace_names_them(name, ordinal):
    assert device_ordinal(name) == ordinal
