"""Hides Gloo's connection lines from the output of a process that meshtrain's launcher did not
start (torchrun, srun, a process started by hand), as `python -m meshtrain.launch` hides them.

On CPU, JAX's collectives across processes run on Gloo, whose C++ code prints "[Gloo] Rank 1 is
connected to 3 peer ranks. Expected number of connected peer ranks is : 3" to file descriptor 1
each time it connects a group of processes: at start-up and at the first collective of every
group (about ten lines per process), with no switch to turn it off. So while such a process
runs, its descriptor 1 is a pipe (a pseudo-terminal when it was a terminal, so that the progress
bar and colours stay) into a small filter process, this file run as a script, which copies
everything to the real output as it comes except those lines. The filter reads until every
writer is gone, so nothing is lost when the process dies, however it dies.

MESHTRAIN_SHOW_GLOO=1 keeps the lines. Imports only the standard library: the filter runs as
`python -I -S quiet_output.py`, without site-packages, in a few milliseconds.
"""

from __future__ import annotations

import atexit
import os
import re
import select
import signal
import subprocess
import sys
from contextlib import suppress

# Gloo's connection report; it may land inside another line of the same process, and through a
# pseudo-terminal its newline may come as \r\n.
GLOO_CHATTER = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    rb"Expected number of connected peer ranks is : \d+\r?\n?"
)
_START = b"[Gloo] Rank "
# Gloo writes its report in pieces (C++ `<<`), ended by one newline. Two threads of one process
# (one per device) connecting at once interleave their pieces: a line of nothing but pieces.
_ONLY_PIECES = re.compile(
    rb"(?:\[Gloo\] Rank | is connected to | peer ranks\. "
    rb"|Expected number of connected peer ranks is : |\d+)*"
)
_LONGEST = 400  # a held tail longer than this is no Gloo report (nor a few interleaved ones)
_WAIT_S = 0.2  # on a terminal, a tail that may yet become a Gloo line waits this long for more
FILTERED_VAR = "MESHTRAIN_OUTPUT_FILTERED"  # set by meshtrain.launch: it filters and counts
SHOW_VAR = "MESHTRAIN_SHOW_GLOO"


class ChatterLines:
    """Gloo's reports out of whole lines, one line at a time (the filter here, and meshtrain.launch
    on each rank's output).

    A report inside another line goes with its newline, and the rest of that line waits for the
    next one (it continues there). A line made only of reports' pieces goes whole: threads
    interleaved their reports, and each report it starts but does not end owes one newline, so
    the owed lines that follow (the rest of a report, or a bare newline) go too."""

    def __init__(self) -> None:
        self.pending = b""  # a line's start whose end a report took: the next line continues it
        self.owed = 0  # reports started whose newline has not yet come
        self.dropped = 0  # reports dropped

    def line(self, line: bytes) -> bytes:
        """One line (ending with its newline) in; what to pass on out: the line, b"" or, with
        the pending start, the joined line."""
        line, self.pending = self.pending + line, b""
        whole = 0
        while True:
            line, found = GLOO_CHATTER.subn(b"", line)
            if not found:
                break
            whole += found
        self.dropped += whole
        if whole and not line.endswith(b"\n"):
            self.pending = line
            return b""
        body = line.rstrip(b"\r\n")
        starts = body.count(_START)
        if _ONLY_PIECES.fullmatch(body) and (starts or self.owed or whole):
            self.owed = max(self.owed + starts - (0 if whole else 1), 0)
            self.dropped += starts
            return b""
        return line

    def take_pending(self) -> bytes:
        """The pending line's start, which the caller passes on itself (a terminal, at once)."""
        pending, self.pending = self.pending, b""
        return pending

    def finish(self) -> bytes:
        """What is left once nothing more will come."""
        rest = self.take_pending()
        return b"" if _ONLY_PIECES.fullmatch(rest.rstrip(b"\r\n")) else rest


class ChatterStream:
    """A byte stream without Gloo's reports: only whole lines pass into a file or pipe; on a
    terminal everything passes at once (a progress bar redraws without a newline) but an
    unfinished line that may yet become a report."""

    def __init__(self, *, terminal: bool) -> None:
        self.terminal = terminal
        self.lines = ChatterLines()
        self.held = b""  # the unfinished last line

    def feed(self, chunk: bytes) -> bytes:
        """The output to pass on now, given the next bytes."""
        text = self.held + chunk
        cut = text.rfind(b"\n") + 1
        lines = text[: cut - 1].split(b"\n") if cut else []
        passed = b"".join(self.lines.line(line + b"\n") for line in lines)
        self.held = text[cut:]
        if not self.terminal:
            return passed
        # What no report can still take passes; from a report's start (interleaved ones: the
        # first), or a "[" that may yet become one, the tail waits.
        tail, self.held = self.lines.take_pending() + self.held, b""
        start = tail.find(_START)
        if start < 0:
            start = tail.rfind(b"[")
            maybe = tail[start:]
            if start < 0 or maybe != _START[: len(maybe)]:
                return passed + tail
        if len(tail) - start >= _LONGEST:
            return passed + tail
        self.held = tail[start:]
        return passed + tail[:start]

    def release(self) -> bytes:
        """The held tail, passed on: on a terminal, a held "[" or "[Gl" that did not grow."""
        held, self.held = self.held, b""
        return held

    def finish(self) -> bytes:
        """What is left once nothing more will come."""
        rest = self.lines.finish() + self.held
        self.held = b""
        return GLOO_CHATTER.sub(b"", rest)


def _write_all(fd: int, data: bytes) -> bool:
    """Writes `data` to `fd`; False once the output is gone (a closed terminal or pipe)."""
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        return False
    return True


def run_filter(source: int = 0, sink: int = 1, *, terminal: bool = False) -> None:
    """The filter's loop: `source` to `sink` without Gloo's lines, until every writer is gone."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # the training process decides when it ends
    stream, alive = ChatterStream(terminal=terminal), True
    while True:
        # On a terminal, a held "[" or "[Gl" that does not grow was no Gloo line; a tail that is
        # one for sure ("[Gloo] Rank ...") waits for its end.
        waits = terminal and stream.held and not stream.held.startswith(_START)
        ready, _, _ = select.select([source], [], [], _WAIT_S if waits else None)
        if not ready:
            alive = alive and _write_all(sink, stream.release())
            continue
        try:
            chunk = os.read(source, 65536)
        except OSError:  # a pseudo-terminal's master reads EIO once its last writer is gone
            chunk = b""
        if not chunk:
            break
        alive = alive and _write_all(sink, stream.feed(chunk))  # without an output, read on
    if alive:
        _write_all(sink, stream.finish())


class _Filter:
    """The filter process of this process's descriptor 1, and the descriptor it replaced."""

    process: subprocess.Popen | None = None
    saved_fd: int | None = None


_filter = _Filter()


def hide_gloo_chatter(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Sends this process's descriptor 1 through the filter; returns whether it did (not when
    meshtrain's launcher started the process, with MESHTRAIN_SHOW_GLOO=1, or done already)."""
    if environ.get(FILTERED_VAR) or environ.get(SHOW_VAR) == "1" or _filter.process is not None:
        return False
    sys.stdout.flush()
    saved = os.dup(1)
    terminal = os.isatty(1)
    if terminal:  # a pseudo-terminal: isatty(1) stays true, and the window's size with it
        import termios
        import tty

        reader, writer = os.openpty()
        tty.setraw(writer)  # bytes pass as written: no \r added to each \n
        size = termios.tcgetwinsize(saved)
        termios.tcsetwinsize(writer, size)
    else:
        reader, writer = os.pipe()
    mode = ["--terminal"] if terminal else []
    process = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), *mode],
        stdin=reader,
        stdout=saved,
        close_fds=True,
        start_new_session=True,  # no signal to this process's group reaches it
    )
    os.close(reader)
    os.dup2(writer, 1)
    os.close(writer)
    _filter.process, _filter.saved_fd = process, saved
    atexit.register(restore_output)
    return True


def restore_output(timeout_s: float = 5.0) -> None:
    """Flushes stdout; with the filter, puts the original descriptor 1 back and waits (up to
    `timeout_s`) for the filter to pass on the rest: called at exit, and before an os._exit, so
    the last lines come before the process is seen to end."""
    with suppress(OSError, ValueError):  # a closed stdout
        sys.stdout.flush()
    process, saved = _filter.process, _filter.saved_fd
    if process is None or saved is None:
        return
    _filter.process = _filter.saved_fd = None
    os.dup2(saved, 1)  # closes this process's end of the pipe: the filter reads to its end
    os.close(saved)
    with suppress(subprocess.TimeoutExpired):  # a child of ours still holds the pipe open
        process.wait(timeout=timeout_s)


if __name__ == "__main__":
    run_filter(terminal="--terminal" in sys.argv[1:])
