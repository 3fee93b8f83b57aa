"""Documented outputs: the fenced blocks of README.md and docs/*.md that show a run's log, and
their comparison with what the documented command prints today.

A block that shows a run's log (LOG_LINE) carries a marker on the line before its fence:

    <!-- output: checked (python 3.12.1, jax 0.12.0.1) -->   the doc tests run the command of
        the bash block before it, as written, and compare (tests/docs/regenerate_docs.py rewrites
        the block and the versions from a new run);
    <!-- output: illustration -->   an example the tests ignore (another machine, a failure, a
        line out of a longer log).

A checked block may show only some of the lines a run prints. Each documented line is matched to
an output line of the same shape (every number a wildcard); then what is deterministic must be
equal: losses, learning rates, parameter counts, bytes, counts. Times, rates, MFU, dates, paths
and ports are matched by pattern (VOLATILE). The numbers that depend on the corpus and XLA (the
default data is this Python's standard library) are compared only on the Python and JAX versions
the block names; elsewhere the shapes are.
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass, field
from importlib.metadata import version

from helpers.docs import Block, fenced_blocks
from helpers.paths import REPO

MARKER = re.compile(r"^<!-- output: (checked \(python (\S+), jax (\S+)\)|illustration) -->$")
# A line of a run's log: meshtrain's log format (with its launcher's rank prefix), the
# launcher's own lines, Hydra's.
LOG_LINE = re.compile(
    r"^(\[rank \d+\] )?((\d\d:\d\d:\d\d )?(DEBUG|INFO|WARNING|ERROR) [\w.]+: |meshtrain\.launch: )"
    r"|\]\[HYDRA\] "
)
DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")))

# What varies from run to run or machine to machine, matched by pattern. Applied in order; a
# span already taken by an earlier pattern is not matched again.
VOLATILE = [
    re.compile(p)
    for p in (
        r"(?<=MFU against ).*",  # the machine's measured matmul peak, its size, cache and date
        r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]",  # Hydra's time stamp
        r"\b\d\d:\d\d:\d\d\b",  # a log line's time
        r"(?<![\w/.])(~|\.\.?)?/[^\s,;)]+|\boutputs/\S+",  # a path
        r"\d{4}-\d\d-\d\d(/\d\d-\d\d-\d\d)?",  # a run directory's date and time
        r"\b\d{1,3}(\.\d{1,3}){3}:\d+",  # a coordinator's address and port
        r"\b\d+(\.\d+)?\s?(s|ms|µs|min)\b",  # a duration
        r"(tokens/s(/device)?|TFLOP/s/device)=[\d,.e+-]+",  # throughput
        r"\b\d+(\.\d+)?%",  # a share of time, or MFU
        r"\beta=\S+",
        r"\bhid \d+ Gloo",
    )
]
NUMBER = re.compile(r"\d+(?:[.,]\d+)*(?:e[+-]?\d+)?")


def environment() -> tuple[str, str]:
    """The Python and JAX versions whose numbers a checked block states."""
    return platform.python_version(), version("jax")


def marker(kind: str, versions: tuple[str, str] | None = None) -> str:
    if kind == "illustration":
        return "<!-- output: illustration -->"
    python, jax = versions or environment()
    return f"<!-- output: checked (python {python}, jax {jax}) -->"


@dataclass(frozen=True)
class OutputBlock:
    """A text block that shows a run's log, with its marker."""

    doc: str
    block: Block
    kind: str | None  # "checked", "illustration", or None: no marker
    versions: tuple[str, str] | None  # a checked block's Python and JAX
    command: str | None  # a checked block's command: the last line of the bash block before
    marker_lineno: int | None = None  # 1-based line of the marker


def output_blocks(doc: str) -> list[OutputBlock]:
    """The blocks of `doc` that show a run's log or carry a marker, in order."""
    lines = (REPO / doc).read_text().splitlines()
    blocks = fenced_blocks("\n".join(lines))
    found = []
    for index, block in enumerate(blocks):
        fence = block.lineno - 1  # 1-based line of the opening fence
        above = lines[fence - 2].strip() if fence >= 2 else ""
        match = MARKER.match(above)
        shows_log = block.lang == "text" and any(LOG_LINE.search(line) for line in block.lines)
        if not (shows_log or match):
            continue
        kind = versions = command = None
        if match:
            kind = "illustration" if match.group(1) == "illustration" else "checked"
            versions = (match.group(2), match.group(3)) if kind == "checked" else None
        if kind == "checked":
            bash = [b for b in blocks[:index] if b.lang == "bash"]
            runnable = [ln.strip() for ln in bash[-1].lines if ln.strip()] if bash else []
            command = runnable[-1] if runnable else None
        found.append(OutputBlock(doc, block, kind, versions, command, fence - 1 if match else None))
    return found


def checked_block(doc: str, command: str) -> OutputBlock | None:
    """The checked block that shows `command`'s output in `doc`, if any."""
    for block in output_blocks(doc):
        if block.kind == "checked" and block.command == command.strip():
            return block
    return None


def _spans(line: str) -> list[tuple[int, int]]:
    taken: list[tuple[int, int]] = []
    for pattern in VOLATILE:
        for m in pattern.finditer(line):
            if m.end() > m.start() and not any(s < m.end() and m.start() < e for s, e in taken):
                taken.append(m.span())
    return sorted(taken)


def pattern(line: str, *, numbers: bool = True) -> re.Pattern[str]:
    """A documented line as a regex: its volatile parts wildcards, whitespace runs elastic and,
    unless `numbers`, every number a wildcard too (the line's shape)."""
    parts, end = [], 0
    for start, stop in _spans(line):
        parts += [_literal(line[end:start], numbers), ".+?" if stop < len(line) else ".*"]
        end = stop
    parts.append(_literal(line[end:], numbers))
    return re.compile("".join(parts).strip())


def _literal(text: str, numbers: bool) -> str:
    pieces, end = [], 0
    for m in NUMBER.finditer(text) if not numbers else ():
        pieces += [_escape(text[end : m.start()]), r"\d+(?:[.,]\d+)*(?:e[+-]?\d+)?"]
        end = m.end()
    pieces.append(_escape(text[end:]))
    return "".join(pieces)


def _escape(text: str) -> str:
    return r"\s+".join(re.escape(word) for word in re.split(r"\s+", text))


@dataclass
class Comparison:
    """Each documented line's counterpart in the output (None: no line of its shape)."""

    documented: list[str]
    matched: list[str | None] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        out = []
        for doc, got, ok in zip(self.documented, self.matched, self.exact, strict=True):
            if got is None:
                out.append(f"no output line like: {doc}")
            elif not ok:
                out.append(f"documented: {doc}\n     prints: {got}")
        return out


def compare(documented: list[str], output: str, *, numbers: bool = True) -> Comparison:
    """Matches each documented line to an unused output line: one equal but for its volatile
    parts (compared numbers with `numbers`), else the first of the same shape."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    used: set[int] = set()
    result = Comparison(documented)
    for doc in documented:
        found = None
        for strict in (True, False):
            regex = pattern(doc, numbers=numbers and strict)
            found = next(
                (i for i, line in enumerate(lines) if i not in used and regex.fullmatch(line)),
                None,
            )
            if found is not None:
                break
        if found is not None:
            used.add(found)
        result.matched.append(lines[found] if found is not None else None)
        result.exact.append(found is not None and strict)
    return result


def check_output(block: OutputBlock, output: str) -> list[str]:
    """The differences between a checked block and `output` ([] when it holds): numbers
    compared where this Python and JAX are the block's, shapes elsewhere."""
    same_environment = block.versions == environment()
    return compare(list(block.block.lines), output, numbers=same_environment).problems


@dataclass(frozen=True)
class Quote:
    """Prose that quotes a number of a checked log: `pattern`'s group 1."""

    doc: str
    pattern: re.Pattern[str]


# The step-1 loss of a global batch of 8, the same on every mesh and process count; quoted from
# docs/profiling.md's checked log (8 devices) and shown again by docs/multi-node.md's (2 × 4).
QUOTES = (
    Quote("docs/parallelism.md", re.compile(r"log `loss=(\d+\.\d+)` at step 1")),
    Quote("docs/multi-node.md", re.compile(r"\(`loss=(\d+\.\d+)`, see")),
)
STEP_1_LOSS = re.compile(r" step 1/\d+ loss=(\d+\.\d+) ")


def step_1_losses(doc: str) -> list[str]:
    """The step-1 losses the checked blocks of `doc` show."""
    return [
        m.group(1)
        for block in output_blocks(doc)
        if block.kind == "checked"
        for line in block.block.lines
        if (m := STEP_1_LOSS.search(line))
    ]


def quoted_loss() -> str:
    """The step-1 loss the prose quotes: docs/profiling.md's checked log's."""
    (loss,) = step_1_losses("docs/profiling.md")
    return loss
