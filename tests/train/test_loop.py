"""End-to-end training in-process: same losses on every mesh, accumulation, the loss falls."""

import json
import math

import jax
import numpy as np
import pytest
from helpers.config import compose_config
from helpers.runs import train_tiny
from helpers.short_training import SHORT_TEXT

from meshtrain.train.describe import describe
from meshtrain.train.setup import prepare

# The short run of helpers.short_training on the standard library's source: a one-layer model,
# sequences of 32 bytes, a constant learning rate after 2 warmup steps. Its compiled step does not
# depend on training.steps: runs of different lengths on one mesh share one program.
FAST = (
    "training.steps=5",
    "training.log_every=1",
    "training.eval_every=0",
    *SHORT_TEXT,
)

# (mesh_shape, micro_batch_size, devices): every mesh trains on the same global batch of 8.
# The README's suite runs the one-device reference and one mesh with dp, fsdp and tp (15 to 20 s
# each); the others are slow, kept out of its 5 minutes.
MESHES = [
    ("[[1,1],[fsdp,tp]]", 8, 1),
    pytest.param("[[8,1],[fsdp,tp]]", 1, 8, marks=pytest.mark.slow),
    pytest.param("[[4,2],[fsdp,tp]]", 2, 8, marks=pytest.mark.slow),
    pytest.param("[[2,4],[fsdp,tp]]", 4, 8, marks=pytest.mark.slow),
    pytest.param("[[1,8],[fsdp,tp]]", 8, 8, marks=pytest.mark.slow),
    pytest.param("[[-1,2],[fsdp,tp]]", 2, 8, marks=pytest.mark.slow),
    ("[[2,2,2],[dp,fsdp,tp]]", 2, 8),
]


def _losses(result):
    return np.array([h["loss"] for h in result.history])


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    mesh_shape, micro, devices = MESHES[0]
    result = train_tiny(
        tmp_path_factory.mktemp("ref"),
        f"model.mesh_shape={mesh_shape}",
        f"training.micro_batch_size={micro}",
        *FAST,
        devices=devices,
    )
    return _losses(result)


@pytest.mark.parametrize(("mesh_shape", "micro", "devices"), MESHES[1:])
def test_same_seed_same_losses_on_every_mesh(mesh_shape, micro, devices, reference_losses, run_dir):
    result = train_tiny(
        run_dir,
        f"model.mesh_shape={mesh_shape}",
        f"training.micro_batch_size={micro}",
        *FAST,
        devices=devices,
    )
    assert result.setup.global_batch == 8
    losses = _losses(result)
    assert len(losses) == 5
    # Sharding reorders fp32 sums (partial matmuls, cross-device reductions): each reordering
    # moves a result by ~1e-7 relative, and five Adam steps keep it well under 1e-5.
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    assert losses[-1] < losses[0]


# kv_heads=2 (15 s) in the slow set, to keep the README suite within its 5 minutes.
@pytest.mark.slow  # about 18 s per case on 2 cores
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_more_tp_ranks_than_key_value_heads_give_the_same_losses(kv_heads, tmp_path):
    """[[1,8]] and [[4,2]] against one device, for 1 and 2 key/value heads: where tp does not
    divide them ([[1,8]] for both, [[4,2]] for 1) the key/value projections are replicated over
    tp, said in the log and counted in plan.json; the losses stay those of one device."""
    heads = (f"model.num_kv_heads={kv_heads}",)
    one = _losses(
        train_tiny(tmp_path / "one", *heads, "training.micro_batch_size=8", *FAST, devices=1)
    )
    for mesh_shape, micro, fsdp, tp in [
        ("[[1,8],[fsdp,tp]]", 8, 1, 8),
        ("[[4,2],[fsdp,tp]]", 2, 4, 2),
    ]:
        run_dir = tmp_path / mesh_shape
        result = train_tiny(
            run_dir,
            *heads,
            f"model.mesh_shape={mesh_shape}",
            f"training.micro_batch_size={micro}",
            *FAST,
        )
        np.testing.assert_allclose(_losses(result), one, rtol=1e-5)
        replicated = kv_heads % tp != 0
        q, k = (result.setup.model.param_shardings["blocks"][0]["attn"][n].spec for n in "qk")
        assert q[1] == "tp"  # query heads split on every mesh
        assert k[1] == (None if replicated else "tp")
        log = (run_dir / "train.log").read_text()
        note = f"does not divide model.num_kv_heads={kv_heads}: the key/value projections"
        assert (note in log) == replicated
        # plan.json: the k and v weights [D, K, H] of every layer, D split over fsdp, in fp32.
        model = result.setup.cfg.model
        kv_bytes = model.num_layers * 2 * model.d_model * kv_heads * model.head_dim * 4 // fsdp
        plan = json.loads((run_dir / "plan.json").read_text())
        assert plan["replicated_kv_bytes"] == (kv_bytes if replicated else 0)
        assert plan["replicated_kv_over"] == (tp if replicated else 1)
        assert plan["replicated_kv_extra_bytes"] == (kv_bytes - kv_bytes // tp if replicated else 0)
        assert ("key/value, whole" in log) == replicated


def test_reference_run_on_one_device(reference_losses):
    # Untrained, the model is near uniform over V = 384 ids, by bounds that follow from the
    # initialisation (std σ = 0.02, width D = 128), not from one XLA version's random numbers:
    # - above: logits of scale σ√D raise the loss over ln V by about σ²D/2 = 0.03 at most;
    # - below: with tied embeddings the residual stream carries each byte's own embedding, whose
    #   logit is at most σD = 2.56 above the rest, so the loss falls below ln V by at most σD
    #   times the share of next bytes that repeat the current one (indentation, in source code).
    V, D, std = 384, 128, 0.02
    data = prepare(compose_config(*FAST), devices=jax.devices()[:1]).train_data
    rows = np.stack([data[i] for i in range(0, len(data), 997)])
    repeats = float(np.mean(rows[:, 1:] == rows[:, :-1]))
    assert math.log(V) - std * D * repeats < reference_losses[0] < math.log(V) + std**2 * D / 2
    assert reference_losses[-1] < reference_losses[0] - 0.5


ONE_STEP = (
    "model.mesh_shape=[[4,2],[fsdp,tp]]",
    "training.steps=1",
    "training.eval_every=0",
    *SHORT_TEXT,
    "training.warmup_steps=1",
)


def _one_step(run_dir, *overrides):
    return train_tiny(run_dir, *ONE_STEP, *overrides)


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    # Adam's first update is lr·g/(|g| + eps). With the default eps=1e-8, entries whose gradient
    # is ~1e-8 turn summation-order noise into update noise of up to lr; eps=1e-3 keeps the
    # update Lipschitz in g (constant lr/eps = 3), so equal gradients must give equal weights.
    common = ("training.adam_eps=1e-3",)
    accumulated = _one_step(
        tmp_path / "a",
        "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=4",
        *common,
    )
    single = _one_step(
        tmp_path / "b",
        "training.micro_batch_size=8",
        "training.gradient_accumulation_steps=1",
        *common,
    )
    assert accumulated.setup.global_batch == single.setup.global_batch == 32
    np.testing.assert_allclose(accumulated.history[0]["loss"], single.history[0]["loss"], rtol=1e-6)
    np.testing.assert_allclose(
        accumulated.history[0]["grad_norm"], single.history[0]["grad_norm"], rtol=1e-5
    )
    for a, b in zip(
        jax.tree.leaves(accumulated.state.params), jax.tree.leaves(single.state.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)


def test_global_batch_size_derives_micro_batch():
    # The start-up decides it (train() runs with this setup): nothing needs compiling.
    cfg = compose_config(
        *ONE_STEP, "training.global_batch_size=16", "training.gradient_accumulation_steps=2"
    )
    setup = prepare(cfg, jax.devices(), with_data=False)
    assert setup.micro_batch_size == 2  # 16 / (fsdp 4 × accumulation 2)
    assert setup.global_batch == 16


@pytest.mark.slow  # about 7 s on 2 cores
def test_bf16_matches_fp32_closely(tmp_path):
    fp32 = _one_step(tmp_path / "a", "training.micro_batch_size=2")
    bf16 = _one_step(tmp_path / "b", "training.micro_batch_size=2", "training.mixed_precision=bf16")
    # bf16 has an 8-bit mantissa: the loss of a near-uniform model moves by well under 1%.
    np.testing.assert_allclose(bf16.history[0]["loss"], fp32.history[0]["loss"], rtol=1e-2)
    assert bf16.history[0]["loss"] != fp32.history[0]["loss"]
    # Master weights stay fp32.
    assert {a.dtype for a in jax.tree.leaves(bf16.state.params)} == {np.dtype("float32")}


def test_default_run_loss_falls_and_writes_its_files(run_dir):
    # The default data, in the short run's shapes and schedule: the compiled step of
    # reference_losses (one device, micro-batch 8), trained for 60 steps, logged every 10 (the
    # default). The loss falls by 3 and val_loss by 2.2 (in 60 steps of the default run: by 3
    # and 2.5).
    result = train_tiny(
        run_dir,
        "training.steps=60",
        "training.eval_every=60",
        "training.eval_batches=2",
        *SHORT_TEXT,
        devices=1,
    )
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 10, 20, 30, 40, 50, 60]
    for line in lines:
        assert {
            "step",
            "loss",
            "learning_rate",
            "grad_norm",
            "tokens_per_sec",
            "step_time_s",
        } <= set(line)
        assert line["tokens_per_sec"] > 0 and line["step_time_s"] > 0
    assert (
        lines[0]["loss"] - lines[-1]["loss"] > 2.0
    )  # from ≈5.95 towards byte-level English/Python
    assert lines[-1]["val_loss"] < lines[0]["loss"] - 2.0
    assert lines[-1]["val_perplexity"] == pytest.approx(math.exp(lines[-1]["val_loss"]))
    assert result.history == lines
    assert "step 60/60" in (run_dir / "train.log").read_text()
    assert list(run_dir.glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_the_loop_reads_from_the_devices_only_at_log_steps(run_dir, monkeypatch):
    """The host waits for the devices only where it must: under a transfer guard that refuses
    every implicit device→host copy (float(x), np.asarray(x), ...), ten steps logged every five
    fetch the step's metrics exactly three times (steps 1, 5 and 10), each in one device_get."""
    metric_fetches = []
    device_get = jax.device_get

    def counting_device_get(tree):
        if isinstance(tree, dict) and "loss" in tree:
            metric_fetches.append(sorted(tree))
        return device_get(tree)

    monkeypatch.setattr(jax, "device_get", counting_device_get)
    with jax.transfer_guard_device_to_host("disallow"):
        # The program of test_same_seed_same_losses_on_every_mesh's [[4,2]] (the constant
        # learning rate of SHORT_TEXT leaves training.steps out of it): compiled once.
        result = train_tiny(
            run_dir,
            "model.mesh_shape=[[4,2],[fsdp,tp]]",
            "training.micro_batch_size=2",
            "training.steps=10",
            "training.log_every=5",
            "training.eval_every=0",
            "checkpoint.every_steps=0",
            *SHORT_TEXT,
        )
    assert [h["step"] for h in result.history] == [1, 5, 10]
    assert metric_fetches == [["grad_norm", "learning_rate", "loss"]] * 3


def test_too_little_data_for_one_global_batch_is_said_in_one_warning(tmp_path, caplog):
    (tmp_path / "doc.txt").write_text("x" * 100)  # bos + 100 + eos: 4 sequences of 32 + 1
    cfg = compose_config(f"data.paths=[{tmp_path / 'doc.txt'}]", "data.seq_len=32")
    with caplog.at_level("WARNING"):
        describe(prepare(cfg, jax.devices()[:1]))
    assert caplog.messages == [
        "data: no validation sequences (no document held out); val_loss is not logged",
        "data: 4 training sequences, fewer than one global batch of 8: each batch holds some "
        "sequences more than once; add documents or lower data.seq_len",
    ]
