"""Pipeline parallelism (train.pipeline): the same losses as without pp for every schedule and
mesh, stage-local parameters, 1f1b's smaller activation memory, checkpoints between pp and
non-pp meshes, and the start-up errors."""

import json

import jax
import numpy as np
import pytest
from helpers.config import compose_config
from helpers.process import RUN_TRAINING, run_launcher, subprocess_env
from helpers.runs import SMALL_RUN, losses, train_tiny

from meshtrain.config.validate import check_against_mesh, check_config
from meshtrain.errors import ConfigError
from meshtrain.parallel.mesh import parse_mesh_shape
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.pipeline import PipelinePlan
from meshtrain.train.setup import compile_train_step, prepare
from meshtrain.train.state import state_shardings

# 4 layers of alternating local and global attention: the stages hold different layer kinds,
# so the kind of each layer must follow it across a stage boundary.
MODEL = (
    "model.num_layers=4",
    "model.scan_layers=true",
    "model.attention_pattern=[local,global]",
    "model.sliding_window=8",
)
# The multi-process tests' short run, with the 4-layer model.
RUN = (*MODEL, *(o for o in SMALL_RUN if not o.startswith("model.num_layers=")))


def _losses(result):
    return np.array([h["loss"] for h in result.history])


@pytest.fixture(scope="module")
def without_pp(tmp_path_factory):
    return _losses(
        train_tiny(tmp_path_factory.mktemp("fsdp"), *RUN, "model.mesh_shape=[[8,1],[fsdp,tp]]")
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(
    ("mesh", "microbatches"),
    [
        ("[[2,4],[pp,fsdp]]", 2),
        # 3D: 12 s for both schedules, kept out of the default suite's 10 minutes
        pytest.param("[[2,2,2],[pp,fsdp,tp]]", 2, marks=pytest.mark.slow),
        ("[[4,2],[pp,fsdp]]", 4),
    ],
)
def test_every_mesh_and_schedule_gives_the_losses_without_pp(
    tmp_path, without_pp, mesh, microbatches, schedule
):
    losses = _losses(
        train_tiny(
            tmp_path,
            *RUN,
            f"model.mesh_shape={mesh}",
            f"training.pipeline.schedule={schedule}",
            f"training.pipeline.microbatches={microbatches}",
        )
    )
    np.testing.assert_allclose(losses, without_pp, rtol=1e-5)


def test_the_log_the_plan_and_the_communication_report(tmp_path):
    train_tiny(
        tmp_path,
        *RUN,
        "model.mesh_shape=[[2,4],[pp,fsdp]]",
        "training.steps=1",
        "training.profile_communication=true",
    )
    log = (tmp_path / "train.log").read_text()
    assert (
        "pipeline: 2 stages, 2 micro-batches, gpipe: bubble 33.3% ((S-1)/(M+S-1)), activations "
        "of 2 micro-batch(es) alive per stage"
    ) in log
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"] == {"dp": 1, "pp": 2, "fsdp": 4, "tp": 1}
    assert plan["pipeline"] == {
        "stages": 2,
        "microbatches": 2,
        "schedule": "gpipe",
        "bubble": pytest.approx(1 / 3),
        "microbatches_alive": 2,
    }
    # The hand-overs between stages: a collective-permute on pp per tick (M + S - 1 = 3),
    # forward and backward.
    report = json.loads((tmp_path / "communication.json").read_text())
    shifts = [
        c
        for c in report["collectives"]
        if c["kind"] == "collective-permute" and c["mesh_axes"] == ["pp"]
    ]
    assert [c["count"] for c in shifts] == [3, 3]


def test_bubble_and_alive_micro_batches_by_the_formula():
    gpipe, one_f_one_b = PipelinePlan(4, 8, "gpipe"), PipelinePlan(4, 8, "1f1b")
    assert gpipe.bubble == one_f_one_b.bubble == pytest.approx(3 / 11)
    assert (gpipe.ticks, one_f_one_b.ticks) == (11, 14)
    assert (gpipe.microbatches_alive, one_f_one_b.microbatches_alive) == (8, 7)
    assert PipelinePlan(2, 16, "1f1b").microbatches_alive == 3


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
        compiled, _ = compile_train_step(
            setup, tx, state_shardings(setup.model, tx, setup.mesh), pad_id=0
        )
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_keeps_less_activation_memory_than_gpipe():
    """M=8, S=2, as compiled: gpipe keeps every micro-batch's activations for the backward
    pass, 1f1b the inputs of at most 3."""
    gpipe, one_f_one_b = _temporaries("gpipe"), _temporaries("1f1b")
    assert one_f_one_b < 0.6 * gpipe, (one_f_one_b, gpipe)


FAST = ("training.steps=4", "checkpoint.every_steps=2", "training.log_every=1")


@pytest.mark.parametrize(
    ("writer", "reader"),
    [("[[2,4],[pp,fsdp]]", "[[8,1],[fsdp,tp]]"), ("[[8,1],[fsdp,tp]]", "[[2,4],[pp,fsdp]]")],
    ids=["pp-to-fsdp", "fsdp-to-pp"],
)
def test_a_checkpoint_resumes_across_pp_and_non_pp_meshes(tmp_path, writer, reader):
    written = train_tiny(tmp_path / "writer", *RUN, *FAST, f"model.mesh_shape={writer}")
    resumed = train_tiny(
        tmp_path / "reader",
        *RUN,
        *FAST,
        f"model.mesh_shape={reader}",
        f"checkpoint.resume={tmp_path / 'writer' / 'checkpoints' / '2'}",
    )
    assert [h["step"] for h in resumed.history] == [3, 4]
    np.testing.assert_allclose(_losses(resumed), _losses(written)[2:], rtol=1e-5)


@pytest.mark.parametrize(
    ("mesh", "overrides", "message"),
    [
        (
            "[[2,4],[pp,fsdp]]",
            ["model.scan_layers=false"],
            "model.mesh_shape has pp=2: pipeline stages hold slices of the stacked blocks; "
            "add model.scan_layers=true",
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
            "training.pipeline.schedule='zigzag' is not supported; use one of: gpipe, 1f1b",
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
