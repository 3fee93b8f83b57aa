"""scripts/checks/sweep_parallelism.py in CI: the sampled combinations of mesh layout, pipeline
schedule, global batch, accumulation and remat each give the fsdp-only losses or a one-line
refusal, and none aborts or hangs (1f1b where pp meets tp included: its hand-overs between
stages once deadlocked XLA's CPU runtime, docs/parallelism.md)."""

import re
import subprocess
import sys

import pytest
from helpers.paths import REPO
from helpers.process import subprocess_env


# 15 to 20 minutes on 2 cores, more than CI's slow set can hold: a rehearsal run with `-m bench`
# (and before a change to the pipeline or the mesh rules); the slow set keeps the per-mesh
# equalities it samples from (test_loop.py, test_pipeline.py, 1f1b with tp included).
@pytest.mark.bench
def test_every_sampled_combination_matches_or_is_refused_in_one_line():
    command = [sys.executable, str(REPO / "scripts" / "checks" / "sweep_parallelism.py")]
    proc = subprocess.run(
        command,
        cwd=REPO,
        env=subprocess_env(8),
        capture_output=True,
        text=True,
        timeout=2400,
    )
    out = proc.stdout
    cases = re.findall(r"^case \d+/\d+: (.*)$", out, re.MULTILINE)
    assert proc.returncode == 0, f"last case started: {cases[-1:]}\n{out[-3000:]}"
    total, matched, refused, failed = map(
        int,
        re.search(r"sweep: (\d+) cases, (\d+) match, (\d+) refused, (\d+) failed", out).groups(),
    )
    assert failed == 0 and total == len(cases) == matched + refused
    # Every mesh of 8 devices over 2 or 3 axes and every schedule that applies, at least once.
    combos = {tuple(c.split(" ")[:2]) for c in cases}
    assert len(combos) == 58  # 16 meshes without pp + 14 with pp × 3 schedules
    assert matched >= 40  # the 15 combinations of cp with pp are refused
