"""Gloo's connection lines hidden from a process meshtrain's launcher did not start: the filter's
rule, and a child process whose descriptor 1 (a pipe, or a terminal) goes through the filter."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import textwrap

import pytest

from meshtrain.distributed.quiet_output import (
    FILTERED_VAR,
    SHOW_VAR,
    ChatterLines,
    ChatterStream,
)

GLOO = (
    b"[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
)


def _filtered(*chunks: bytes, terminal: bool = True) -> tuple[bytes, bytes, int]:
    """(what passed, what is held, reports dropped) after feeding the chunks."""
    stream = ChatterStream(terminal=terminal)
    passed = b"".join(stream.feed(chunk) for chunk in chunks)
    return passed, stream.held + stream.lines.pending, stream.lines.dropped


def test_whole_lines_and_lines_inside_another_are_dropped_and_counted():
    text = b"a\n" + GLOO + b"12:00 INFO " + GLOO + b"step 1\n" + GLOO.replace(b"\n", b"\r\n")
    assert _filtered(text) == (b"a\n12:00 INFO step 1\n", b"", 3)


def test_an_unfinished_gloo_line_is_held_until_it_ends_and_anything_else_passes_at_once():
    assert _filtered(b"ok\n" + GLOO[:30]) == (b"ok\n", GLOO[:30], 0)
    assert _filtered(GLOO[:30], GLOO[30:] + b"next\n") == (b"next\n", b"", 1)
    assert _filtered(b"ok\n[Glo") == (b"ok\n", b"[Glo", 0)  # may yet be one
    # a progress bar's redraw (no newline, escape codes with "[") passes at once
    assert _filtered(b"\r\x1b[2Kstep 5/200") == (b"\r\x1b[2Kstep 5/200", b"", 0)
    assert _filtered(b"[rank 0] x") == (b"[rank 0] x", b"", 0)
    stream = ChatterStream(terminal=True)
    assert stream.feed(GLOO[:30]) == b"" and stream.finish() == GLOO[:30]


def test_into_a_file_or_pipe_only_whole_lines_pass():
    """C's buffered stdout cuts a Gloo line anywhere, its rest coming a buffer later."""
    assert _filtered(b"a\nb", terminal=False) == (b"a\n", b"b", 0)
    assert _filtered(b"x\n" + GLOO[:-1], terminal=False) == (b"x\n", GLOO[:-1], 0)
    assert _filtered(GLOO[:-1], b"\ny\n", terminal=False) == (b"y\n", b"", 1)  # no blank


# Two threads of one process (one per device) reporting at once, as CI once printed them: one
# report inside another's pieces, then two reports' pieces on one line and a bare newline.
INTERLEAVED = (
    b"[Gloo] Rank 2 is connected to 7"
    b"[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n"
    b" peer ranks. Expected number of connected peer ranks is : 7\n"
    b"[Gloo] Rank 1 is connected to 1[Gloo] Rank 0 is connected to  peer ranks. 1Expected number"
    b" of connected peer ranks is :  peer ranks. 1Expected number of connected peer ranks is : 1\n"
    b"\n"
)


@pytest.mark.parametrize("terminal", [False, True])
def test_reports_that_threads_interleaved_are_dropped_whole(terminal):
    text = b"12:00 INFO compiled\n" + INTERLEAVED + b"12:01 INFO step 1\n\nend\n"
    expected = b"12:00 INFO compiled\n12:01 INFO step 1\n\nend\n"  # the user's blank line stays
    assert _filtered(text, terminal=terminal) == (expected, b"", 4)
    # and cut anywhere, as buffers cut them
    for cut in range(0, len(text), 7):
        assert _filtered(text[:cut], text[cut:], terminal=terminal)[::2] == (expected, 4)


def test_a_line_of_digits_is_output_unless_a_report_owes_it():
    lines = ChatterLines()
    assert lines.line(b"7\n") == b"7\n"
    assert lines.line(b"[Gloo] Rank 1 is connected to 1[Gloo] Rank 0 is connected to \n") == b""
    assert lines.line(b" peer ranks. 1Expected number of connected peer ranks is : 1\n") == b""
    assert lines.line(b"7\n") == b"7\n"
    assert lines.dropped == 2 and lines.owed == 0


CHILD = textwrap.dedent(
    """
    import os, sys, time
    from meshtrain.distributed.quiet_output import hide_gloo_chatter
    print("before", flush=True)
    print("filtered:", hide_gloo_chatter(), "tty:", os.isatty(1), flush=True)
    gloo = {gloo!r}
    os.write(1, b"one\\n" + gloo + b"two " + gloo[:40])  # as C++ writes: around Python
    time.sleep(0.05)
    os.write(1, gloo[40:] + b"three\\n")
    os.write(1, gloo[:-1])  # a buffer's end before the newline, the rest well after
    time.sleep(0.5)
    os.write(1, b"\\nfour\\n")
    print("last line", flush=True)
    """
).format(gloo=GLOO)


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (FILTERED_VAR, SHOW_VAR)}
    return {**env, **extra}


def test_a_child_writing_to_a_pipe_shows_everything_but_gloos_lines():
    result = subprocess.run(
        [sys.executable, "-c", CHILD], env=_child_env(), capture_output=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().splitlines() == [
        "before",
        "filtered: True tty: False",
        "one",
        "two three",
        "four",
        "last line",
    ]


@pytest.mark.parametrize(("variable", "shown"), [(FILTERED_VAR, "1"), (SHOW_VAR, "1")])
def test_under_meshtrain_launch_or_with_show_gloo_nothing_is_filtered(variable, shown):
    result = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=_child_env(**{variable: shown}),
        capture_output=True,
        timeout=60,
    )
    assert b"filtered: False" in result.stdout and result.stdout.count(b"[Gloo]") == 3


def test_on_a_terminal_the_process_still_sees_a_terminal_and_gloos_lines_go():
    reader, writer = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], env=_child_env(), stdout=writer, stderr=writer
    )
    os.close(writer)
    output = b""
    while True:
        try:
            chunk = os.read(reader, 65536)
        except OSError:  # EIO: every writer is gone
            break
        if not chunk:
            break
        output += chunk
    os.close(reader)
    assert child.wait(timeout=60) == 0
    lines = output.decode().replace("\r\n", "\n").splitlines()
    assert lines == [
        "before",
        "filtered: True tty: True",
        "one",
        "two three",
        "four",
        "last line",
    ]
