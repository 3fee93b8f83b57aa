"""Pipeline parallelism (train.pipeline): the same losses as without pp for every schedule and
mesh, stage-local parameters, 1f1b's smaller activation memory, checkpoints between pp and
non-pp meshes, and the start-up errors."""

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest
from helpers.config import compose_config
from helpers.process import RUN_TRAINING, run_launcher, subprocess_env
from helpers.runs import SMALL_RUN, losses, train_tiny

from meshtrain.config.validate import check_against_mesh, check_config
from meshtrain.errors import ConfigError
from meshtrain.observe.hlo import parse_shape
from meshtrain.parallel.mesh import parse_mesh_shape
from meshtrain.train.compilation import compile_train_step
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.pipeline_plan import PipelinePlan, layer_table
from meshtrain.train.setup import prepare
from meshtrain.train.state import state_shardings

# 4 layers of alternating local and global attention: the stages hold different layer kinds,
# so the kind of each layer must follow it across a stage boundary.
MODEL = (
    "model.num_layers=4",
    "model.scan_layers=true",
    "model.attention_pattern=[local,global]",
    "model.sliding_window=8",
)
SCHEDULES = ("gpipe", "circular", "1f1b")
# The multi-process tests' short run, with the 4-layer model.
RUN = (*MODEL, *(o for o in SMALL_RUN if not o.startswith("model.num_layers=")))


def _losses(result):
    return np.array([h["loss"] for h in result.history])


# Every run of `runs` saves a checkpoint at each step (checkpoint.every_steps changes no program):
# test_a_checkpoint_resumes_across_pp_and_non_pp_meshes resumes from them.
WRITER = ("checkpoint.every_steps=1",)


class Written(NamedTuple):
    losses: np.ndarray
    run_dir: Path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(mesh, microbatches, schedule) → Written: each pipelined run of RUN trains once in this
    module, and serves every test that asks for it. Every run writes communication.json too."""
    done = {}

    def run(mesh, microbatches=None, schedule="gpipe"):
        key = (mesh, microbatches, schedule)
        if key not in done:
            run_dir = tmp_path_factory.mktemp("run")
            pipeline = (
                () if microbatches is None else (f"training.pipeline.microbatches={microbatches}",)
            )
            result = train_tiny(
                run_dir,
                *RUN,
                *WRITER,
                f"model.mesh_shape={mesh}",
                f"training.pipeline.schedule={schedule}",
                *pipeline,
                "training.profile_communication=true",
            )
            done[key] = Written(_losses(result), run_dir)
        return done[key]

    return run


@pytest.fixture(scope="module")
def without_pp(runs):
    return runs("[[8,1],[fsdp,tp]]").losses


def _case(mesh, microbatches, schedule, *marks):
    return pytest.param(mesh, microbatches, schedule, marks=marks, id=f"{mesh}-{schedule}")


@pytest.mark.parametrize(
    ("mesh", "microbatches", "schedule"),
    [
        # Slow ones (3D: 18 s; circular and [[4,2]]'s gpipe: 10 s) are kept out of the default
        # suite's 10 minutes; CI runs them, and scripts/checks/sweep_parallelism.py every combination.
        *(_case("[[2,4],[pp,fsdp]]", 2, s) for s in ("gpipe", "1f1b")),
        _case("[[2,4],[pp,fsdp]]", 2, "circular", pytest.mark.slow),
        *(_case("[[2,2,2],[pp,fsdp,tp]]", 2, s, pytest.mark.slow) for s in SCHEDULES),
        _case("[[4,2],[pp,fsdp]]", 4, "gpipe", pytest.mark.slow),
        _case("[[4,2],[pp,fsdp]]", 4, "1f1b"),
    ],
)
@pytest.mark.slow
def test_every_mesh_and_schedule_gives_the_losses_without_pp(
    runs, without_pp, mesh, microbatches, schedule
):
    """Circular, with 2 layers per stage and 2 repeats, runs layers (0, 2) on stage 0 and
    (1, 3) on stage 1: local and global layers at the same step of the two stages' scans."""
    losses = runs(mesh, microbatches, schedule).losses
    np.testing.assert_allclose(losses, without_pp, rtol=1e-5)


@pytest.mark.slow  # 18 s, kept out of the README suite's 5 minutes (CI runs the slow set too)
def test_1f1b_with_tp_and_rows_split_over_fsdp_compiles_and_matches(tmp_path):
    """Global batch 16 in 4 pipeline micro-batches on [[2,2,2],[pp,fsdp,tp]]: 2 rows per fsdp
    shard in each. The loss inside the pipeline takes the targets' logits by a select, not a
    gather, which XLA's partitioner aborted on (vocabulary split over tp, rows over fsdp).
    Also: model.scan_layers, unset, turns on by itself for the pp mesh and says so."""
    common = ("data=synthetic", "data.seq_len=32", "model.num_layers=4")
    common += ("training.global_batch_size=16", "training.steps=2", "training.warmup_steps=1")
    pipelined = train_tiny(
        tmp_path / "pp",
        *common,
        "model.mesh_shape=[[2,2,2],[pp,fsdp,tp]]",
        "training.pipeline.schedule=1f1b",
        "training.pipeline.microbatches=4",
    )
    assert pipelined.setup.cfg.model.scan_layers is True
    log = (tmp_path / "pp" / "train.log").read_text()
    assert "model.scan_layers: on, for the pp stages" in log
    reference = train_tiny(tmp_path / "fsdp", *common, "model.mesh_shape=[[8,1],[fsdp,tp]]")
    assert reference.setup.cfg.model.scan_layers is False
    np.testing.assert_allclose(_losses(pipelined), _losses(reference), rtol=1e-5)


@pytest.mark.slow  # an 8-layer model: 4 stages of 2 layers, so that circular can interleave
def test_circular_on_four_stages_gives_the_losses_without_pp(tmp_path):
    eight = (*RUN, "model.num_layers=8")
    flat = train_tiny(tmp_path / "flat", *eight, "model.mesh_shape=[[8,1],[fsdp,tp]]")
    circular = train_tiny(
        tmp_path / "circular",
        *eight,
        "model.mesh_shape=[[4,2],[pp,fsdp]]",
        "training.pipeline.schedule=circular",
        "training.pipeline.microbatches=4",
    )
    np.testing.assert_allclose(_losses(circular), _losses(flat), rtol=1e-5)


@pytest.mark.parametrize(
    ("layers_per_stage", "schedule"),
    [("[3,1]", "gpipe"), pytest.param("[1,3]", "1f1b", marks=pytest.mark.slow)],
)
@pytest.mark.slow
def test_uneven_stages_give_the_losses_without_pp(tmp_path, without_pp, layers_per_stage, schedule):
    result = train_tiny(
        tmp_path,
        *RUN,
        "model.mesh_shape=[[2,4],[pp,fsdp]]",
        f"model.pipeline.layers_per_stage={layers_per_stage}",
        f"training.pipeline.schedule={schedule}",
    )
    np.testing.assert_allclose(_losses(result), without_pp, rtol=1e-5)
    # pp=2 divides the 4 layers: each stage still stores 2 of them.
    assert result.setup.model.param_shardings["blocks"]["mlp"]["up"].spec[0] == "pp"


@pytest.mark.slow  # about 7 s on 2 cores
def test_stages_that_do_not_divide_the_layers_store_them_whole(tmp_path, without_pp):
    """pp=3 over 4 layers, [2, 1, 1]: the stacked blocks cannot split over pp, so every stage
    stores them (sharded over fsdp) and runs its own."""
    result = train_tiny(
        tmp_path,
        *RUN,
        "model.mesh_shape=[[3,2],[pp,fsdp]]",
        "model.pipeline.layers_per_stage=[2,1,1]",
        "training.pipeline.microbatches=4",
        devices=6,
    )
    np.testing.assert_allclose(_losses(result), without_pp, rtol=1e-5)
    assert result.setup.model.param_shardings["blocks"]["mlp"]["up"].spec[0] is None
    assert (
        "pp=3 does not divide model.num_layers=4: every stage stores all the stacked blocks "
        "(sharded over the other axes as without pp) and runs the layers of "
        "model.pipeline.layers_per_stage=[2, 1, 1]"
    ) in (tmp_path / "train.log").read_text()


@pytest.mark.slow  # three runs of a 6-layer model
def test_gemma_layer_pattern_crosses_stage_boundaries(tmp_path):
    """Gemma 3's 5 local : 1 global layers, 6 of them on 2 stages: stage 0 runs local layers
    only, stage 1 two local and the global one (gpipe), or interleaved chunks (circular)."""
    gemma = (
        *RUN,
        "model.num_layers=6",
        "model.attention_pattern=[local,local,local,local,local,global]",
    )
    flat = _losses(train_tiny(tmp_path / "flat", *gemma, "model.mesh_shape=[[8,1],[fsdp,tp]]"))
    for schedule in ("gpipe", "circular"):
        piped = train_tiny(
            tmp_path / schedule,
            *gemma,
            "model.mesh_shape=[[2,4],[pp,fsdp]]",
            f"training.pipeline.schedule={schedule}",
        )
        np.testing.assert_allclose(_losses(piped), flat, rtol=1e-5)


@pytest.mark.slow
def test_the_log_the_plan_and_the_communication_report(runs):
    # The default micro-batches (pp = 2) and schedule (gpipe): the run of the gpipe case above.
    tmp_path = runs("[[2,4],[pp,fsdp]]", 2).run_dir
    log = (tmp_path / "train.log").read_text()
    assert (
        "pipeline: 2 stages, 2 micro-batches, gpipe: bubble 33.3% ((S-1)/(M+S-1)), activations "
        "of 2 micro-batch(es) alive per stage"
    ) in log
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"] == {"dp": 1, "pp": 2, "fsdp": 4, "ep": 1, "cp": 1, "tp": 1}
    assert plan["pipeline"] == {
        "stages": 2,
        "microbatches": 2,
        "schedule": "gpipe",
        "repeats": 1,
        "layers_per_stage": None,
        "ticks": 3,
        "bubble": pytest.approx(1 / 3),
        "microbatches_alive": 2,
    }
    # The hand-overs between stages: a collective-permute on pp per tick (M + S - 1 = 3),
    # forward and backward.
    assert _hand_overs(tmp_path) == [3, 3]


def _hand_overs(run_dir):
    report = json.loads((run_dir / "communication.json").read_text())
    return [
        c["count"]
        for c in report["collectives"]
        if c["kind"] == "collective-permute" and c["mesh_axes"] == ["pp"]
    ]


@pytest.mark.slow
def test_circular_logs_its_bubble_and_measures_it_under_the_profiler(tmp_path, without_pp):
    result = train_tiny(
        tmp_path,
        *RUN,
        "model.mesh_shape=[[2,4],[pp,fsdp]]",
        "training.pipeline.schedule=circular",
        "training.steps=3",
        "training.profile=true",
        "profile.start_step=2",
        "profile.num_steps=2",
        "training.profile_communication=true",
    )
    np.testing.assert_allclose(_losses(result), without_pp, rtol=1e-5)  # the profiler aside
    log = (tmp_path / "train.log").read_text()
    assert (
        "pipeline: 2 stages, 2 micro-batches, circular × 2 repeats: bubble 20.0% "
        "((S-1)/(R·M+S-1)), activations of 2 micro-batch(es) alive per stage"
    ) in log
    # R·M + S - 1 = 5 ticks, each chunk of layers one tick; the chunks move to their stages by
    # all-to-alls over pp: each stacked leaf's shard by one all-to-all of its own size. The
    # gradients come back the same way, except that XLA may return a small leaf by another
    # collective (jax 0.12 brings the norm scales back by an all-gather over pp).
    assert _hand_overs(tmp_path) == [5, 5]
    report = json.loads((tmp_path / "communication.json").read_text())
    moves = [
        c for c in report["collectives"] if c["kind"] == "all-to-all" and c["mesh_axes"] == ["pp"]
    ]
    moved = Counter(
        sum(math.prod(a.dims) for shape in c["shapes"] for a in parse_shape(shape)) for c in moves
    )
    model = result.setup.model
    leaves = jax.tree.leaves(model.abstract_params["blocks"])
    shards = Counter(
        math.prod(sharding.shard_shape(leaf.shape))
        for leaf, sharding in zip(
            leaves, jax.tree.leaves(model.param_shardings["blocks"]), strict=True
        )
    )
    assert not shards - moved, f"stacked leaves not moved forward: {shards - moved}"
    assert len(leaves) <= len(moves) <= 2 * len(leaves)
    # Every tick costs the same (idle ones compute and discard): the measured bubble is the
    # formula's, within the noise of a 2-core machine.
    measured = re.search(
        r"profiler: pipeline bubble ([\d.]+)% of the ticks \(formula 20.0%\), ([\d.]+)% of the "
        r"step; ticks of [\d.]+ ms \(median\), the pipeline's loops ([\d.]+)% of the step",
        log,
    )
    assert measured, log[-2000:]
    bubble, of_step, loops = (float(g) / 100 for g in measured.groups())
    assert abs(bubble - 0.2) < 0.05
    assert 0.0 < loops <= 1.0
    assert of_step == pytest.approx(bubble * loops, abs=0.01)


def test_bubble_and_alive_micro_batches_by_the_formula():
    gpipe, circular = PipelinePlan(4, 8, "gpipe"), PipelinePlan(4, 8, "circular", repeats=2)
    one_f_one_b = PipelinePlan(4, 8, "1f1b")
    assert (gpipe.ticks, circular.ticks, one_f_one_b.ticks) == (11, 19, 14)
    assert gpipe.bubble == pytest.approx(3 / 11)
    assert circular.bubble == pytest.approx(3 / 19)
    # 1f1b's lock-step ticks: the warm-up ticks run no backward, the cool-down ones no forward.
    assert one_f_one_b.bubble == pytest.approx(6 / 14)
    assert (gpipe.microbatches_alive, one_f_one_b.microbatches_alive) == (8, 7)
    assert circular.microbatches_alive == 8
    assert PipelinePlan(2, 16, "1f1b").microbatches_alive == 3
    for plan in (gpipe, circular, one_f_one_b):  # the formula, tick by tick
        for stage in range(4):
            idle = sum(plan.idle_share(stage, tick) for tick in range(plan.ticks))
            assert idle == plan.idle_ticks


def test_which_layer_each_stage_runs():
    circular = layer_table(PipelinePlan(2, 2, "circular", repeats=2), 8)
    assert circular.tolist() == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    uneven = layer_table(PipelinePlan(3, 3, "gpipe", layers_per_stage=(3, 2, 1)), 6)
    assert uneven.tolist() == [[[0, 1, 2]], [[3, 4, -1]], [[5, -1, -1]]]
    assert layer_table(PipelinePlan(2, 2, "gpipe"), 4).tolist() == [[[0, 1]], [[2, 3]]]


def _setup(mesh, *overrides, devices=8):
    cfg = compose_config(*MODEL, "data=synthetic", f"model.mesh_shape={mesh}", *overrides)
    return prepare(cfg, jax.devices()[:devices], with_data=False)


def test_a_stage_holds_its_layers_only():
    """Per device, the stacked blocks take 1/pp of their bytes; the rest is as without pp."""

    def per_device(setup, leaves):
        return sum(
            np.prod(s.shard_shape(p.shape)) * p.dtype.itemsize
            for p, s in zip(jax.tree.leaves(leaves[0]), jax.tree.leaves(leaves[1]), strict=True)
        )

    for pp in (2, 4):
        piped = _setup(f"[[{pp},{8 // pp}],[pp,fsdp]]")
        flat = _setup(f"[[1,{8 // pp}],[pp,fsdp]]", devices=8 // pp)
        blocks = lambda s: (s.model.abstract_params["blocks"], s.model.param_shardings["blocks"])  # noqa: E731
        assert per_device(piped, blocks(piped)) * pp == per_device(flat, blocks(flat))
        spec = piped.model.param_shardings["blocks"]["mlp"]["up"].spec
        assert spec[0] == "pp"


def _temporaries(schedule):
    setup = _setup(
        "[[2,4],[pp,fsdp]]",
        "data.seq_len=256",
        "training.global_batch_size=32",
        f"training.pipeline.schedule={schedule}",
        "training.pipeline.microbatches=8",
    )
    tx = build_optimizer(setup.cfg.training)
    with jax.set_mesh(setup.mesh):
        compiled, _ = compile_train_step(setup, tx, state_shardings(setup.model, tx, setup.mesh))
    return compiled.memory_analysis().temp_size_in_bytes


# slow: 11 s, kept out of the README suite's 5 minutes (CI runs the slow set too)
@pytest.mark.slow
def test_1f1b_keeps_less_activation_memory_than_gpipe():
    """M=8, S=2, as compiled: gpipe keeps every micro-batch's activations for the backward
    pass, 1f1b the inputs of at most 3."""
    gpipe, one_f_one_b = _temporaries("gpipe"), _temporaries("1f1b")
    assert one_f_one_b < 0.6 * gpipe, (one_f_one_b, gpipe)


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        pytest.param(("[[2,4],[pp,fsdp]]", 2), "[[8,1],[fsdp,tp]]", marks=pytest.mark.slow),
        (("[[8,1],[fsdp,tp]]",), "[[2,4],[pp,fsdp]]"),
    ],
    ids=["pp-to-fsdp", "fsdp-to-pp"],
)
@pytest.mark.slow
def test_a_checkpoint_resumes_across_pp_and_non_pp_meshes(tmp_path, runs, writer, reader):
    """The writer is a 3-step run of `runs` (a checkpoint every step); the reader resumes from
    its step 1 with the program the reader's mesh compiled for `runs` already."""
    written = runs(*writer)
    resumed = train_tiny(
        tmp_path,
        *RUN,
        *WRITER,
        f"model.mesh_shape={reader}",
        f"checkpoint.resume={written.run_dir / 'checkpoints' / '1'}",
    )
    assert [h["step"] for h in resumed.history] == [2, 3]
    np.testing.assert_allclose(_losses(resumed), written.losses[1:], rtol=1e-5)


@pytest.mark.parametrize(
    ("mesh", "overrides", "message"),
    [
        (
            "[[2,4],[pp,fsdp]]",
            ["model.scan_layers=false"],
            "model.scan_layers=false with pp=2 in model.mesh_shape: pipeline stages hold slices "
            "of the stacked blocks; remove model.scan_layers=false (pp meshes turn it on)",
        ),
        (
            "[[8,1],[pp,fsdp]]",
            [],
            "pp=8 in model.mesh_shape does not split model.num_layers=4 into equal stages; "
            "use pp in {1, 2, 4}",
        ),
        (
            "[[2,4],[pp,fsdp]]",
            ["training.pipeline.microbatches=3"],
            "training.pipeline.microbatches=3 does not split the micro-batch of 8 sequences into "
            "whole batch shards (4 per pipeline micro-batch); use one of 1, 2",
        ),
        (
            "[[2,4],[pp,fsdp]]",
            ["training.pipeline.microbatches=1", "training.pipeline.schedule=1f1b"],
            "training.pipeline.microbatches=1 is fewer than the pp=2 stages; 1f1b needs at "
            "least 2: use training.pipeline.microbatches=4",
        ),
        (
            "[[2,4],[pp,fsdp]]",
            ["training.pipeline.schedule=zigzag"],
            "training.pipeline.schedule='zigzag' is not supported; use one of: gpipe, circular, "
            "1f1b",
        ),
        (
            "[[4,2],[pp,fsdp]]",
            ["model.num_layers=6"],
            "pp=4 in model.mesh_shape does not split model.num_layers=6 into equal stages; use "
            "pp in {1, 2, 3, 6}, or model.pipeline.layers_per_stage=[2, 2, 1, 1]",
        ),
        (
            "[[2,4],[pp,fsdp]]",
            ["model.pipeline.layers_per_stage=[1,1,2]"],
            "model.pipeline.layers_per_stage=[1, 1, 2] lists 3 stages, but model.mesh_shape has "
            "pp=2; list 2 counts, e.g. [2, 2]",
        ),
        (
            "[[2,4],[pp,fsdp]]",
            ["model.pipeline.layers_per_stage=[4,0]"],
            "model.pipeline.layers_per_stage=[4, 0] leaves stage 1 without layers; every stage "
            "needs at least one, e.g. [2, 2]",
        ),
        (
            "[[2,4],[pp,fsdp]]",
            ["model.pipeline.layers_per_stage=[3,2]"],
            "model.pipeline.layers_per_stage=[3, 2] sums to 5, not model.num_layers=4; e.g. [2, 2]",
        ),
        (
            "[[8,1],[fsdp,tp]]",
            ["model.pipeline.layers_per_stage=[2,2]"],
            "model.pipeline.layers_per_stage=[2, 2] splits the layers into pipeline stages, but "
            "model.mesh_shape has no pp axis; add one (e.g. [[2,-1],[pp,fsdp]]) or drop "
            "model.pipeline.layers_per_stage",
        ),
        (
            "[[2,4],[pp,fsdp]]",
            ["training.pipeline.repeats=2"],
            "training.pipeline.repeats=2 applies to the circular schedule, not gpipe; add "
            "training.pipeline.schedule=circular or drop training.pipeline.repeats",
        ),
        (
            "[[2,4],[pp,fsdp]]",
            ["training.pipeline.schedule=circular", "training.pipeline.repeats=3"],
            "training.pipeline.repeats=3 does not divide the 2 layers per stage "
            "(model.num_layers=4 over pp=2); use one of 1, 2",
        ),
        (
            "[[4,2],[pp,fsdp]]",
            ["training.pipeline.schedule=circular"],
            "training.pipeline.schedule=circular loops through the layers of each stage in "
            "chunks, but model.num_layers=4 over pp=4 leaves 1 per stage; use fewer stages, or "
            "training.pipeline.schedule=gpipe",
        ),
        (
            "[[2,4],[pp,fsdp]]",
            ["training.pipeline.schedule=circular", "model.pipeline.layers_per_stage=[3,1]"],
            "model.pipeline.layers_per_stage=[3, 1] gives stages of different sizes, which the "
            "circular schedule cannot interleave; use training.pipeline.schedule=gpipe or 1f1b, "
            "or equal stages",
        ),
        (
            "[[2,4],[pp,fsdp]]",
            ["training.pipeline.microbatches=1", "training.pipeline.schedule=circular"],
            "training.pipeline.microbatches=1 is fewer than the pp=2 stages; circular needs at "
            "least 2: use training.pipeline.microbatches=4",
        ),
        (
            "[[2,4],[pp,fsdp]]",
            ["model.logical_axis_rules.layers=null"],
            "model.logical_axis_rules.layers=None with pp=2 in model.mesh_shape: each stage "
            "holds its own layers; set model.logical_axis_rules.layers=pp",
        ),
    ],
)
def test_pipeline_errors_name_the_key_and_the_fix(mesh, overrides, message):
    cfg = compose_config(
        *MODEL, "training.global_batch_size=8", f"model.mesh_shape={mesh}", *overrides
    )
    with pytest.raises(ConfigError) as error:
        check_config(cfg)
        check_against_mesh(cfg, parse_mesh_shape(cfg.model.mesh_shape, 8))
    assert str(error.value) == message


@pytest.mark.slow  # two processes start, compile and train: about a minute on 2 cores
def test_stages_split_across_two_processes_give_the_same_losses(tmp_path, without_pp):
    """2 processes × 4 faked devices over gloo, [[2,4],[pp,fsdp]]: process 0 holds stage 0 and
    process 1 stage 1, so the activations cross between processes every tick."""
    result = run_launcher(
        "--nprocs",
        "2",
        "--devices-per-process",
        "4",
        str(RUN_TRAINING),
        *RUN,
        "model.mesh_shape=[[2,4],[pp,fsdp]]",
        "training.pipeline.schedule=1f1b",
        f"hydra.run.dir={tmp_path}",
        env=subprocess_env(1),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "metrics.jsonl"), without_pp, rtol=1e-5)
    assert "pipeline: 2 stages" in (tmp_path / "train.log").read_text()
