"""Checkpoints in-process: resharded restore, fallback from damaged files, fingerprints, errors."""

import dataclasses
import gc
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.commands import train_command
from helpers.config import compose_config
from helpers.process import assert_one_line_error
from helpers.runs import train_tiny
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.checkpoint import (
    CorruptCheckpoint,
    RunCheckpoints,
    committed_steps,
    read_meta,
    read_state,
)
from meshtrain.checkpoint.layout import fingerprints
from meshtrain.data import BatchIterator
from meshtrain.errors import ConfigError
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.setup import prepare
from meshtrain.train.state import (
    abstract_train_state,
    create_train_state,
    join_state,
    split_state,
    state_shardings,
)
from meshtrain.weights.initial_weights import check_initial_weights, load_initial_params

FAST = ("training.log_every=1", "training.eval_every=0", "training.warmup_steps=1")
WRITER = ("model.mesh_shape=[[8,1],[fsdp,tp]]", "training.micro_batch_size=1")


def _losses(result, steps):
    by_step = {h["step"]: h["loss"] for h in result.history}
    return np.array([by_step[s] for s in steps])


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """6 uninterrupted steps on [[8,1]] (global batch 8), checkpoints after steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("writer")
    result = train_tiny(run_dir, *WRITER, "training.steps=6", "checkpoint.every_steps=3", *FAST)
    return run_dir, result


@pytest.mark.slow
def test_checkpoint_holds_the_state_data_position_and_config(written):
    run_dir, result = written
    directory = run_dir / "checkpoints"
    assert committed_steps(directory) == [3, 6]
    meta = read_meta(directory / "3")
    assert (
        meta["step"] == 3
        and meta["data"] == {"step": 3, "position": 24}
        and meta["global_batch"] == 8
    )
    assert meta["config"]["model"]["mesh_shape"] == [[8, 1], ["fsdp", "tp"]]
    assert meta["config"]["training"]["steps"] == 6
    # The fingerprints cover params, optimizer moments, step, RNG key and the non-finite record.
    names = set(meta["fingerprints"])
    assert {
        "params.embed",
        "params.blocks.1.mlp.down",
        "train_state.step",
        "train_state.rng",
    } <= names
    assert "train_state.opt_state.1.0.mu.blocks.0.attn.q" in names
    assert "train_state.nonfinite.skipped" in names
    # The final checkpoint is the state train() returned, array for array.
    assert read_meta(directory / "6")["fingerprints"] == {
        **fingerprints(result.state.params, "params."),
        **fingerprints(result.state.replace(params=None), "train_state."),
    }


@pytest.mark.parametrize(
    ("mesh", "micro", "devices"),
    [("[[2,4],[fsdp,tp]]", 4, 8), ("[[1,1],[fsdp,tp]]", 8, 1)],
    ids=["2x4-on-8-devices", "1x1-on-1-device"],
)
@pytest.mark.slow
def test_restore_onto_another_mesh_continues_the_loss_curve(written, mesh, micro, devices, run_dir):
    writer_dir, uninterrupted = written
    resumed = train_tiny(
        run_dir,
        f"model.mesh_shape={mesh}",
        f"training.micro_batch_size={micro}",
        "training.steps=6",
        f"checkpoint.resume={writer_dir / 'checkpoints' / '3'}",
        *FAST,
        devices=devices,
    )
    assert [h["step"] for h in resumed.history] == [4, 5, 6]
    assert "at step 3" in (run_dir / "train.log").read_text()
    # Another mesh sums in another order (partial matmuls, cross-device reductions): ~1e-7
    # relative per step, well under 1e-5 after three Adam steps.
    np.testing.assert_allclose(
        _losses(resumed, [4, 5, 6]), _losses(uninterrupted, [4, 5, 6]), rtol=1e-5
    )
    for new, old in zip(
        jax.tree.leaves(resumed.state.params),
        jax.tree.leaves(uninterrupted.state.params),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(new), np.asarray(old), rtol=1e-4, atol=1e-6)


def _abstract(cfg, devices):
    setup = prepare(cfg, devices)
    tx = build_optimizer(cfg.training)
    return setup, abstract_train_state(
        setup.model, tx, state_shardings(setup.model, tx, setup.mesh)
    )


def _read_state(path, abstract):
    """(train state, meta) of the checkpoint at `path`, read into the shardings of `abstract`."""
    params, rest, meta = read_state(path, *split_state(abstract))
    return join_state(params, rest), meta


def test_each_array_is_read_into_its_new_shards_with_int_keys_intact(written):
    run_dir, result = written
    cfg = compose_config("model.mesh_shape=[[2,4],[fsdp,tp]]", "training.micro_batch_size=4")
    _, abstract = _abstract(cfg, jax.devices())
    state, meta = _read_state(run_dir / "checkpoints" / "6", abstract)
    # The model's block list gives int keys (blocks.0, blocks.1): the tree comes back the same.
    assert jax.tree.structure(state) == jax.tree.structure(abstract)
    assert sorted(state.params["blocks"]) == [0, 1]
    embed = state.params["embed"]  # [vocab 384, embed 128] over (tp=4, fsdp=2)
    assert embed.sharding == abstract.params["embed"].sharding
    assert embed.sharding.spec == PartitionSpec("tp", "fsdp")
    assert {shard.data.shape for shard in embed.addressable_shards} == {(96, 64)}
    np.testing.assert_array_equal(np.asarray(embed), np.asarray(result.state.params["embed"]))
    assert int(state.step) == 6 and meta["data"] == {"step": 6, "position": 48}


def test_fingerprint_is_exact_on_any_sharding_and_sees_one_flipped_bit():
    x = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32)
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("a", "b")))
    assert fingerprints({"x": x}) == fingerprints({"x": sharded})
    bits = np.asarray(x).view(np.uint32).copy()
    bits[17, 3] ^= 1  # the lowest mantissa bit of one element
    assert fingerprints({"x": bits.view(np.float32)}) != fingerprints({"x": x})
    swapped = np.asarray(x).copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert fingerprints({"x": swapped}) != fingerprints({"x": x})
    assert fingerprints({"x": x.astype(jnp.bfloat16)}) != fingerprints({"x": x})


def _data_files(step_dir: Path, item: str) -> list[Path]:
    return sorted((step_dir / item).glob("ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size)


def _flip_a_byte(step_dir: Path) -> None:
    biggest = _data_files(step_dir, "params")[-1]
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x10
    biggest.write_bytes(bytes(data))


def _truncate(step_dir: Path) -> None:
    biggest = _data_files(step_dir, "train_state")[-1]
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])


def _garble_meta(step_dir: Path) -> None:
    (step_dir / "meta" / "metadata").write_text('{"format": 1, "step": 6, "fingerp')


def _drop_manifest(step_dir: Path) -> None:
    (step_dir / "params" / "manifest.ocdbt").unlink()


# orbax leaves the reads of other shards un-awaited when one fails; Python reports them.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (_flip_a_byte, "does not match the fingerprint written with it"),
        (_truncate, "has unreadable arrays"),
        (_garble_meta, "meta is unreadable (JSONDecodeError"),
        (_drop_manifest, "has unreadable arrays"),
    ],
    ids=["flipped-byte", "truncated-file", "garbled-json", "missing-file"],
)
def test_damaged_checkpoint_is_reported(written, tmp_path, damage, expected):
    copy = tmp_path / "6"
    shutil.copytree(written[0] / "checkpoints" / "6", copy)
    damage(copy)
    _, abstract = _abstract(compose_config(*WRITER), jax.devices())
    with pytest.raises(CorruptCheckpoint) as err:
        _read_state(copy, abstract)
    message = str(err.value)
    assert expected in message
    assert str(copy) in message
    del err  # its traceback holds orbax's abandoned reads: let them go while warnings are off
    gc.collect()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(written, tmp_path):
    writer_dir, uninterrupted = written
    directory = tmp_path / "checkpoints"
    shutil.copytree(writer_dir / "checkpoints", directory)
    _flip_a_byte(directory / "6")
    resumed = train_tiny(
        tmp_path / "run", *WRITER, "training.steps=6", f"checkpoint.dir={directory}", *FAST
    )
    gc.collect()  # orbax's abandoned reads of the damaged checkpoint, while warnings are off
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"WARNING meshtrain.checkpoint.manager: {directory}/6: array params." in log
    assert "does not match the fingerprint written with it" in log
    assert f"moved the damaged checkpoint {directory}/6 aside to {directory}/6.corrupted" in log
    assert f"resuming from {directory}/3 at step 3" in log
    assert (directory / "6.corrupted" / "params").is_dir()  # kept for inspection, not deleted
    assert committed_steps(directory) == [3, 6]  # step 6 saved anew
    # Same mesh, same compiled step: the curve continues bit for bit.
    np.testing.assert_array_equal(_losses(resumed, [4, 5, 6]), _losses(uninterrupted, [4, 5, 6]))
    assert (
        read_meta(directory / "6")["fingerprints"]
        == read_meta(writer_dir / "checkpoints" / "6")["fingerprints"]
    )


def _checkpoints(cfg, setup, tx, run_dir):
    """The run's checkpoints, opened as train() opens them, its initial weights checked."""
    abstract = abstract_train_state(setup.model, tx, state_shardings(setup.model, tx, setup.mesh))
    checkpoints = RunCheckpoints.open(
        cfg.checkpoint,
        run_dir,
        *split_state(abstract),
        steps=cfg.training.steps,
        run_meta={"config": dataclasses.asdict(cfg)},
    )
    check_initial_weights(cfg, setup.model, resuming=checkpoints.resuming)
    return checkpoints


def _open(run_dir, *overrides, devices=1):
    cfg = compose_config(*overrides)
    setup = prepare(cfg, jax.devices()[:devices])
    return _checkpoints(cfg, setup, build_optimizer(cfg.training), run_dir)


def test_unwritable_checkpoint_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError) as err:
        _open(tmp_path / "run", f"checkpoint.dir={blocker}/checkpoints")
    assert str(err.value) == (
        f"checkpoint.dir={blocker}/checkpoints is not writable (Not a directory); "
        "set checkpoint.dir=<a writable directory>"
    )


def test_missing_resume_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        _open(tmp_path / "run", f"checkpoint.resume={tmp_path}/nowhere/checkpoints/100")
    assert str(err.value).startswith(
        f"checkpoint.resume={tmp_path}/nowhere/checkpoints/100 does not exist; give a checkpoint"
    )
    with pytest.raises(ConfigError) as err:
        _open(tmp_path / "run", f"checkpoint.load_params={tmp_path}")
    assert f"checkpoint.load_params={tmp_path} holds no complete checkpoint" in str(err.value)


def test_checkpoint_of_another_model_names_the_first_mismatch(written, tmp_path):
    source = written[0] / "checkpoints"
    with pytest.raises(ConfigError) as err:
        _open(tmp_path / "run", f"checkpoint.resume={source}", "model.num_kv_heads=4")
    assert (
        f"checkpoint.resume: {source}/6 was written for another model: parameter "
        "blocks.0.attn.k has shape (128, 8, 16) in the checkpoint but (128, 4, 16) in the model"
    ) in str(err.value)
    with pytest.raises(ConfigError) as err:
        _open(tmp_path / "run", f"checkpoint.load_params={source}/3", "model.num_layers=3")
    assert "the model's parameter blocks.2.attn.k (128, 8, 16) is not in the checkpoint" in str(
        err.value
    )
    # Without clipping, optax's chain has one element less: another optimizer state, not damage.
    with pytest.raises(ConfigError) as err:
        _open(tmp_path / "run", f"checkpoint.resume={source}", "training.grad_clip=0")
    assert str(err.value).startswith(
        f"checkpoint.resume: {source}/6 was written with other optimizer settings: this run's "
        "train state has opt_state.0.count, which the checkpoint does not; resume with the "
    )


def test_resume_never_refuses_a_used_directory_unless_told_to_overwrite(written, tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(written[0] / "checkpoints", directory)
    with pytest.raises(ConfigError) as err:
        _open(tmp_path, "checkpoint.resume=never")
    assert f"checkpoint.resume=never, but checkpoint.dir={directory} already holds" in str(
        err.value
    )
    assert "(steps 3, 6)" in str(err.value)
    assert committed_steps(directory) == [3, 6]  # nothing touched
    # Told to overwrite: they go once the fresh state exists, before its first save.
    checkpoints = _open(tmp_path, "checkpoint.resume=never", "checkpoint.overwrite=true")
    assert committed_steps(directory) == [3, 6]
    with checkpoints:
        _, _, start = checkpoints.restore_or_init(lambda: split_state(written[1].state), None)
    assert start == 0 and committed_steps(directory) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["checkpoint.keep=0"], "checkpoint.keep=0 must be >= 1"),
        (["checkpoint.every_steps=-1"], "checkpoint.every_steps=-1 must be >= 0"),
        (
            ["checkpoint.resume=/x", "checkpoint.load_params=/y"],
            "checkpoint.resume=/x and checkpoint.load_params=/y are both set",
        ),
    ],
)
def test_bad_checkpoint_values(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        _open(tmp_path, *overrides)
    assert message in str(err.value)


def test_load_params_starts_fresh_around_the_saved_weights(written, tmp_path):
    source = written[0] / "checkpoints" / "3"
    cfg = compose_config("model.mesh_shape=[[4,2],[fsdp,tp]]", f"checkpoint.load_params={source}")
    setup = prepare(cfg, jax.devices())
    tx = build_optimizer(cfg.training)
    shardings = state_shardings(setup.model, tx, setup.mesh)
    abstract = abstract_train_state(setup.model, tx, shardings)
    batches = BatchIterator(
        setup.train_data, global_batch=8, accum_steps=1, rows=slice(0, 8), seed=0
    )
    with _checkpoints(cfg, setup, tx, tmp_path) as checkpoints:

        def init():
            params = load_initial_params(
                cfg, setup.model, checkpoint_dir_of_run=checkpoints.directory
            )
            return split_state(create_train_state(cfg.model, tx, shardings, 0, params))

        params, rest, start = checkpoints.restore_or_init(init, batches)
    state = join_state(params, rest)
    saved, _ = _read_state(source, abstract)
    assert fingerprints(state.params) == fingerprints(saved.params)
    assert fingerprints(state.params) != fingerprints(written[1].state.params)  # step 3, not 6
    assert start == 0 and int(state.step) == 0 and batches.get_state() == {"step": 0, "position": 0}
    adam = state.opt_state[1][0]
    assert int(adam.count) == 0
    assert all(not np.any(np.asarray(m)) for m in jax.tree.leaves(adam.mu))


def test_checkpoint_error_on_the_command_line(written, tmp_path):
    """The path every checkpoint ConfigError takes (its messages are checked above): one line,
    exit code 2, before anything is compiled, and the checkpoint it names is left untouched."""
    source = written[0] / "checkpoints"
    before = {p.relative_to(source): p.stat().st_mtime_ns for p in source.rglob("*")}
    result = train_command(
        f"checkpoint.resume={source}",
        "model.num_kv_heads=4",
        f"hydra.run.dir={tmp_path}",
        devices=1,
    )
    assert_one_line_error(
        result,
        f"checkpoint {source}/6 cannot be continued with this config: model.num_kv_heads 8 → 4; "
        "put the old value back, start a new run directory (hydra.run.dir=...), start fresh "
        "from these weights in a new run directory with "
        f"checkpoint.load_params={source}/6, or accept the change on purpose with "
        "checkpoint.allow_changes=[model.num_kv_heads]",
    )
    assert not (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "checkpoints").exists()
    assert {p.relative_to(source): p.stat().st_mtime_ns for p in source.rglob("*")} == before
