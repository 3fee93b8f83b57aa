"""Re-measures the times and sizes that README.md and docs/ state, so that a stale claim is caught.

    python scripts/checks/check_claims.py [--all] [--suite] [--strict] [--json]

Each claim is a sentence of a document (CLAIMS: the file, the exact words, the number they
state) and the command that measures it on this machine. The script prints, for each, the
number claimed, the number measured and whether they agree within a factor of TOLERANCE either
way (a time: a claim that became too slow, or too pessimistic, is stale), or to the rounding of
the digits stated (a size the memory planner computes: it does not depend on the machine).
A time is wall time (unit "s" or "min") or CPU time, user and system of the command and its
children ("cpu s", "cpu min"): the wall time of a loaded machine grows with the load, its CPU
time much less. Without flags it measures the quick claims (about 2 minutes on 2 cores); --all
adds the long planning compiles (about 3 minutes more), --suite the default test suite (about
11 minutes more). --strict exits with 1 when a measured claim disagrees. The first line printed
is the machine's state (cores, load average): the docs' times were measured on a quiet 2-core
machine (README.md#measured-times), so measure on one like it. CI (.ci/run) runs it without
--strict, as a report that fails nothing: on a shared machine, the noise would decide.

tests/scripts/test_check_claims.py checks, without timing anything, that every claim's words
are still in its document and that README.md states no time or size this script does not
measure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1.5  # a claim holds when claimed / 1.5 <= measured <= claimed × 1.5

README_27B_PLAN = (
    'model=gemma3_27b \'model.mesh_shape=[[8,2],["fsdp","tp"]]\' training.dry_run=true '
    "plan.fake_devices=16 plan.device=h100 data.seq_len=4096 training.micro_batch_size=1 "
    "model.remat=full model.scan_layers=true"
)
PLANNING_27B = (
    'model=gemma3_27b \'model.mesh_shape=[[8,2],["fsdp","tp"]]\' training.dry_run=true '
    "plan.fake_devices=16 plan.device=h100 training.micro_batch_size=1"
)
COMPILED = re.compile(r"compiled the train step in ([\d.]+) s")
PLANNED_TOTAL = re.compile(r"total\s+([\d.]+) GiB")  # the memory plan's total per device


@dataclass(frozen=True)
class Claim:
    """A number a document states, and how to measure it here."""

    doc: str  # path from the repository root
    words: str  # the exact words in the document that state it
    claimed: float  # the number the words state, in `unit`
    unit: str  # "s", "min" (wall time), "cpu s", "cpu min" (CPU time), "%" or "GiB"
    measure: str  # a key of MEASURES
    group: str = "quick"  # quick, all (long planning compiles) or suite

    @property
    def exact(self) -> bool:
        """A size the planner computes: it holds to the rounding of its digits."""
        return self.unit == "GiB"


@dataclass
class Launch:
    """One command's wall time, CPU time (user + system, its children included) and output."""

    seconds: float
    output: str
    cpu_seconds: float = 0.0


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_state() -> str:
    """The conditions of a measurement: CPU, the cores this process may use, load average."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"machine: {_cpu_name()}, {cores} cores, load average {load} (1, 5, 15 min)"


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def _launch(command: str, workdir: Path, env: dict[str, str] | None = None) -> Launch:
    """`command` in bash, in `workdir` (which has run_training.py and configs/ linked)."""
    for name in ("run_training.py", "configs"):
        if not (workdir / name).exists():
            (workdir / name).symlink_to(REPO / name)
    environment = {**os.environ, **(env or {})}
    start, cpu_start = time.perf_counter(), _children_cpu_s()
    result = subprocess.run(
        ["bash", "-c", command],
        cwd=workdir,
        env=environment,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    seconds, cpu_seconds = time.perf_counter() - start, _children_cpu_s() - cpu_start
    if result.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return Launch(seconds, result.stdout + result.stderr, cpu_seconds)


def _compiled_s(launch: Launch) -> float:
    return float(COMPILED.findall(launch.output)[-1])


class Measurements:
    """The measuring commands; each runs once, however many claims use it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._done: dict[str, object] = {}

    def _once(self, key: str, run: Callable[[], object]) -> object:
        if key not in self._done:
            print(f"measuring: {key}...", file=sys.stderr, flush=True)
            self._done[key] = run()
        return self._done[key]

    def default_training(self) -> tuple[Launch, Launch]:
        """The README's `python run_training.py` with empty caches (a cache root of its own: the
        packed corpus, the compiled programs, the matmul peak), then again with them warm."""

        def run() -> tuple[Launch, Launch]:
            env = {"MESHTRAIN_CACHE_DIR": str(self.workdir / "cache")}
            env["JAX_COMPILATION_CACHE_DIR"] = str(self.workdir / "cache" / "jax")
            command = "python run_training.py hydra.run.dir=default_{}"
            cold = _launch(command.format("cold"), self.workdir, env)
            return cold, _launch(command.format("warm"), self.workdir, env)

        return self._once("default training", run)  # type: ignore[return-value]

    def progress_bar_cpu_percent(self) -> float:
        """CPU time of the progress bar's thread over the loop, in % of one core, for the
        default run on a pseudo-terminal."""

        def run() -> float:
            probe = (
                "import runpy, sys\n"
                "from meshtrain.observe import progress\n"
                "close = progress.ProgressBar.close\n"
                "def report(bar):\n"
                "    close(bar)\n"
                "    print(f'BAR {bar.cpu_percent:.4f}', file=sys.stderr)\n"
                "progress.ProgressBar.close = report\n"
                "sys.argv = ['run_training.py', 'hydra.run.dir=bar']\n"
                "runpy.run_path('run_training.py', run_name='__main__')\n"
            )
            (self.workdir / "bar_probe.py").write_text(probe)
            # `script` gives the run a pseudo-terminal, as an interactive shell would.
            launch = _launch("script -qec 'python bar_probe.py' /dev/null", self.workdir)
            return float(re.findall(r"BAR ([\d.]+)", launch.output)[-1])

        return self._once("progress bar CPU", run)  # type: ignore[return-value]

    def compile_cache(self) -> tuple[Launch, Launch]:
        """docs/checkpointing.md's 3-step launch of the tiny model on 8 faked devices, with an
        empty and then a warm JAX compilation cache."""

        def run() -> tuple[Launch, Launch]:
            cache = self.workdir / "jax_cache"
            env = {
                "JAX_COMPILATION_CACHE_DIR": str(cache),
                "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
            }
            command = (
                "python run_training.py 'model.mesh_shape=[[8,1],[fsdp,tp]]' training.steps=3 "
                "training.eval_every=0 hydra.run.dir=cache_{}"
            )
            cold = _launch(command.format("cold"), self.workdir, env)
            warm = _launch(command.format("warm"), self.workdir, env)
            return cold, warm

        return self._once("compile cache", run)  # type: ignore[return-value]

    def plan(self, overrides: str) -> Launch:
        """A dry run, compiled from scratch (an empty compilation cache of its own)."""

        def run() -> Launch:
            cache = Path(tempfile.mkdtemp(prefix="plan-", dir=self.workdir))
            env = {"MESHTRAIN_CACHE_DIR": str(cache), "JAX_COMPILATION_CACHE_DIR": str(cache)}
            return _launch(f"python run_training.py {overrides}", self.workdir, env)

        return self._once(f"dry run {overrides}", run)  # type: ignore[return-value]

    def suite(self) -> Launch:
        """The README's `python -m pytest -q -n 2`: its wall and CPU time, in seconds."""

        def run() -> Launch:
            start, cpu_start = time.perf_counter(), _children_cpu_s()
            result = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"],
                cwd=REPO,
            )
            if result.returncode != 0:
                raise RuntimeError("the test suite failed")
            return Launch(time.perf_counter() - start, "", _children_cpu_s() - cpu_start)

        return self._once("test suite", run)  # type: ignore[return-value]


MEASURES: dict[str, Callable[[Measurements], float]] = {
    "default_training_cold_s": lambda m: m.default_training()[0].seconds,
    "default_training_warm_s": lambda m: m.default_training()[1].seconds,
    "default_training_cold_cpu_s": lambda m: m.default_training()[0].cpu_seconds,
    "default_training_warm_cpu_s": lambda m: m.default_training()[1].cpu_seconds,
    "progress_bar_cpu_percent": lambda m: m.progress_bar_cpu_percent(),
    "readme_27b_plan_s": lambda m: m.plan(README_27B_PLAN).seconds,
    "readme_27b_plan_cpu_s": lambda m: m.plan(README_27B_PLAN).cpu_seconds,
    "readme_27b_plan_gib": lambda m: float(
        PLANNED_TOTAL.findall(m.plan(README_27B_PLAN).output)[-1]
    ),
    "cold_compile_s": lambda m: _compiled_s(m.compile_cache()[0]),
    "warm_compile_s": lambda m: _compiled_s(m.compile_cache()[1]),
    "cold_launch_s": lambda m: m.compile_cache()[0].seconds,
    "warm_launch_s": lambda m: m.compile_cache()[1].seconds,
    "planning_27b_compile_s": lambda m: _compiled_s(m.plan(PLANNING_27B)),
    "planning_27b_scan_compile_s": lambda m: _compiled_s(
        m.plan(PLANNING_27B + " model.remat=full model.scan_layers=true")
    ),
    "planning_27b_scan_dry_run_s": lambda m: (
        m.plan(PLANNING_27B + " model.remat=full model.scan_layers=true").seconds
    ),
    "suite_min": lambda m: m.suite().seconds / 60,
    "suite_cpu_min": lambda m: m.suite().cpu_seconds / 60,
}

CLAIMS = (
    Claim("README.md", "about 20 s of\nwall time", 20, "s", "default_training_cold_s"),
    Claim("README.md", "45 s of CPU time", 45, "cpu s", "default_training_cold_cpu_s"),
    Claim(
        "README.md",
        "about 15 s and 35 s of CPU time once its caches are warm",
        15,
        "s",
        "default_training_warm_s",
    ),
    Claim(
        "README.md",
        "about 15 s and 35 s of CPU time once its caches are warm",
        35,
        "cpu s",
        "default_training_warm_cpu_s",
    ),
    Claim("README.md", "about 0.7%\nof one core", 0.7, "%", "progress_bar_cpu_percent"),
    Claim("README.md", "planned in about 17 s of wall time", 17, "s", "readme_27b_plan_s"),
    Claim("README.md", "(25 s of CPU time)", 25, "cpu s", "readme_27b_plan_cpu_s"),
    Claim("README.md", "35.50 GiB per device", 35.50, "GiB", "readme_27b_plan_gib"),
    Claim(
        "README.md",
        "in about 5\nminutes of wall time",
        5,
        "min",
        "suite_min",
        "suite",
    ),
    Claim("README.md", "and 9 of CPU time on a quiet", 9, "cpu min", "suite_cpu_min", "suite"),
    Claim("docs/checkpointing.md", "compiled its train step in 0.5 s", 0.5, "s", "warm_compile_s"),
    Claim("docs/checkpointing.md", "instead of 2.5 s", 2.5, "s", "cold_compile_s"),
    Claim("docs/checkpointing.md", "took 5.7 s", 5.7, "s", "warm_launch_s"),
    Claim("docs/checkpointing.md", "instead of 7.9 s in all", 7.9, "s", "cold_launch_s"),
    Claim(
        "docs/planning.md",
        "it took 70 s for Gemma 3 27B below",
        70,
        "s",
        "planning_27b_compile_s",
        "all",
    ),
    Claim(
        "docs/planning.md",
        "4.1 s instead of 70 s",
        4.1,
        "s",
        "planning_27b_scan_compile_s",
        "all",
    ),
    Claim(
        "docs/planning.md",
        "about 8 s of wall time and at most 0.8 GB",
        8,
        "s",
        "planning_27b_scan_dry_run_s",
        "all",
    ),
)


def holds(claimed: float, measured: float, *, exact: bool = False) -> bool:
    if exact:  # the same number to the digits stated
        return f"{measured:.{_decimals(claimed)}f}" == f"{claimed:.{_decimals(claimed)}f}"
    return claimed / TOLERANCE <= measured <= claimed * TOLERANCE


def _decimals(number: float) -> int:
    text = repr(number)
    return len(text.split(".")[1]) if "." in text else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="also the long planning compiles")
    parser.add_argument("--suite", action="store_true", help="also time the default test suite")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a claim disagrees")
    parser.add_argument("--json", action="store_true", help="one JSON object per claim")
    args = parser.parse_args(argv)
    groups = {"quick"} | ({"all"} if args.all else set()) | ({"suite"} if args.suite else set())
    stale = 0
    print(machine_state(), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="meshtrain-claims-") as workdir:
        measurements = Measurements(Path(workdir))
        for claim in CLAIMS:
            if claim.group not in groups:
                continue
            measured = MEASURES[claim.measure](measurements)
            ok = holds(claim.claimed, measured, exact=claim.exact)
            stale += not ok
            words = " ".join(claim.words.split())
            if args.json:
                record = {
                    "doc": claim.doc,
                    "words": words,
                    "claimed": claim.claimed,
                    "measured": round(measured, 3),
                    "unit": claim.unit,
                    "holds": ok,
                }
                print(json.dumps(record), flush=True)
            else:
                verdict = "holds" if ok else "STALE"
                print(
                    f"{verdict:5}  {claim.doc}: {words!r}: claimed {claim.claimed:g} "
                    f"{claim.unit}, measured {measured:.3g} {claim.unit}",
                    flush=True,
                )
    return 1 if args.strict and stale else 0


if __name__ == "__main__":
    sys.exit(main())
