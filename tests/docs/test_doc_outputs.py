"""Every block of README.md and docs/ that shows a run's log is checked or marked an
illustration (tests/helpers/doc_outputs.py); how a checked block is compared; the step-1 loss
the prose quotes is the checked logs'. The comparisons themselves run with the commands, in
tests/docs/test_profiling_docs.py (planning and profiling) and test_docs_multi_node.py."""

from __future__ import annotations

import pytest
from helpers.doc_outputs import (
    DOCS,
    QUOTES,
    check_output,
    compare,
    environment,
    output_blocks,
    quoted_loss,
    step_1_losses,
)
from helpers.docs import ENTRY, doc_commands
from helpers.paths import REPO

LAUNCH = "python -m meshtrain.launch"
# The docs whose tests run a checked block's command and compare its output.
COMPARED_IN = {
    "docs/planning.md": "tests/docs/test_profiling_docs.py",
    "docs/profiling.md": "tests/docs/test_profiling_docs.py",
    "docs/multi-node.md": "tests/docs/test_docs_multi_node.py",
}
BLOCKS = [block for doc in DOCS for block in output_blocks(doc)]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.doc}:{b.block.lineno}")
def test_a_block_that_shows_a_log_is_checked_or_an_illustration(block):
    assert block.kind in ("checked", "illustration"), (
        f"{block.doc}:{block.block.lineno} shows a run's log without a marker: put "
        "<!-- output: illustration --> on the line before its fence, or make a doc test run its "
        "command (<!-- output: checked (...) -->, then python tests/docs/regenerate_docs.py)"
    )
    if block.kind == "checked":
        assert block.doc in COMPARED_IN, f"no doc test runs the commands of {block.doc}"
        assert block.command and (ENTRY in block.command or block.command.startswith(LAUNCH))


def test_each_checked_block_is_the_output_of_a_command_its_doc_test_runs():
    checked = [b for b in BLOCKS if b.kind == "checked"]
    assert len(checked) >= 7
    for block in checked:
        if block.command.startswith(LAUNCH):
            continue  # tests/docs/test_docs_multi_node.py runs the launcher lines it finds
        (command,) = [c for c in doc_commands(block.doc) if c.line == block.command]
        assert command.output == block


STEP = (
    "15:19:55 INFO meshtrain.observe.metrics: step 1/20 loss=5.8135 lr=1.50e-04 grad_norm=7.94 "
    "step_time=0.216s tokens/s=4,749 tokens/s/device=594 TFLOP/s/device=0.00251 mfu=6.0% "
    "data_wait=0.0006s eta=?"
)


def test_times_rates_dates_paths_and_ports_match_by_pattern():
    printed = (
        "01:02:03 INFO meshtrain.observe.metrics: step 1/20 loss=5.8135 lr=1.50e-04 "
        "grad_norm=7.94 step_time=1.5s tokens/s=12,000 tokens/s/device=1,500 "
        "TFLOP/s/device=0.1 mfu=12.5% data_wait=0.1s eta=3m2s"
    )
    assert compare([STEP], f"noise\n{printed}\n").problems == []
    lines = [
        "[rank 0] 15:20:29 INFO meshtrain.distributed.runtime: process 0 of 2 joined (coordinator 127.0.0.1:46449)",
        "15:19:58 INFO meshtrain.train.loop: finished 20 steps in /home/me/meshtrain/outputs/tiny/2026-11-25/15-19-49",
        "meshtrain.launch: ranks 0..1 of 2, MESHTRAIN_RUN_ID=2026-01-31/12-00-00",
        "15:19:53 INFO meshtrain.train.setup: compiled the train step in 2.3 s",
    ]
    printed = [
        "[rank 0] 09:00:00 INFO meshtrain.distributed.runtime: process 0 of 2 joined (coordinator 127.0.0.1:5123)",
        "09:00:00 INFO meshtrain.train.loop: finished 20 steps in /tmp/x/outputs/tiny/2026-12-01/09-00-00",
        "meshtrain.launch: ranks 0..1 of 2, MESHTRAIN_RUN_ID=2026-12-01/09-00-00",
        "09:00:00 INFO meshtrain.train.setup: compiled the train step in 14.0 s",
    ]
    assert compare(lines, "\n".join(reversed(printed))).problems == []  # in any order


def test_a_changed_loss_or_a_missing_line_is_a_difference():
    other = STEP.replace("loss=5.8135", "loss=5.8143")
    (problem,) = compare([STEP], other).problems
    assert problem == f"documented: {STEP}\n     prints: {other}"
    assert compare([STEP], other, numbers=False).problems == []  # the same shape
    (problem,) = compare([STEP], "01:02:03 INFO meshtrain.train.loop: finished").problems
    assert problem.startswith("no output line like: ")


def test_numbers_are_compared_only_on_the_blocks_python_and_jax():
    block = next(b for b in BLOCKS if b.doc == "docs/profiling.md" and b.kind == "checked")
    changed = "\n".join(block.block.lines).replace("loss=", "loss=9")
    if block.versions == environment():
        assert check_output(block, changed)
    elsewhere = type(block)(block.doc, block.block, "checked", ("0.0.0", "0.0"), block.command)
    assert check_output(elsewhere, changed) == []


@pytest.mark.parametrize("quote", QUOTES, ids=lambda q: q.doc)
def test_the_prose_quotes_the_checked_logs_step_1_loss(quote):
    (quoted,) = quote.pattern.findall((REPO / quote.doc).read_text())
    assert quoted == quoted_loss()
    assert step_1_losses("docs/multi-node.md") == [quoted_loss()]  # 2 processes, 1 process


def test_the_regenerating_script_exists_and_lists_the_checked_commands(capsys):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("regen", REPO / "tests/docs/regenerate_docs.py")
    regen = importlib.util.module_from_spec(spec)
    sys.modules["regen"] = regen
    spec.loader.exec_module(regen)
    assert regen.main(["docs/profiling.md", "--list"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("docs/profiling.md:") and "training.profile=true" in line
