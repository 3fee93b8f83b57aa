"""Gradient synchronisation (train.gradients): dp reduced once per update, fsdp every
training.sync_gradients_every micro-batches, reductions in training.reduce_dtype; the losses of
one device, the bytes of communication.json and the buffer of plan.json."""

import json

import numpy as np
import pytest
from helpers.runs import train_tiny

RUN = (
    "data=synthetic",
    "training.global_batch_size=32",
    "training.gradient_accumulation_steps=4",
    "training.steps=3",
    "training.log_every=1",
    "training.warmup_steps=1",
    "training.eval_every=0",
    "training.profile_communication=true",
)
PARAMS = 639_616  # the tiny model's parameters
LARGE = 1024  # bytes: smaller collectives carry the loss and the token count, not gradients


def _run(run_dir, mesh_shape, *overrides, devices=None):
    result = train_tiny(
        run_dir, *RUN, f"model.mesh_shape={mesh_shape}", *overrides, devices=devices
    )
    report = json.loads((run_dir / "communication.json").read_text())
    plan = json.loads((run_dir / "plan.json").read_text())
    return np.array([h["loss"] for h in result.history]), report, plan


def _gradient_reductions(report, axes):
    """The collectives that reduce gradients over exactly these mesh axes."""
    return [
        c
        for c in report["collectives"]
        if c["kind"] in ("all-reduce", "reduce-scatter")
        and c["mesh_axes"] == axes
        and c["ring_bytes_per_step"] / c["count"] > LARGE
    ]


def _bytes(collectives, key="ring_bytes_per_step"):
    return sum(c[key] for c in collectives)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one"), "[[1,1],[fsdp,tp]]", devices=1)[0]


@pytest.mark.slow  # about 7 s on 2 cores
def test_replicas_reduce_their_gradients_once_per_update(tmp_path, one_device):
    """[[2,4,1],[dp,fsdp,tp]] with 4 micro-batches: each replica sums its own gradients and the
    dp all-reduce runs once, moving each device's gradient shard once (ring, dp=2: 2·(1/2)·S)."""
    losses, report, plan = _run(tmp_path, "[[2,4,1],[dp,fsdp,tp]]")
    np.testing.assert_allclose(losses, one_device, rtol=1e-5)
    dp = _gradient_reductions(report, ["dp"])
    assert dp and all(c["count"] == 1 for c in dp)
    assert _bytes(dp) == pytest.approx(plan["grad_bytes"], rel=1e-3)
    assert plan["unsharded_grad_bytes"] == 0


@pytest.fixture(scope="module")
def every(tmp_path_factory):
    """sync_gradients_every → (losses, report, plan) on [[8,1]] with 4 micro-batches."""
    return {
        k: _run(
            tmp_path_factory.mktemp(f"every{k}"),
            "[[8,1],[fsdp,tp]]",
            f"training.sync_gradients_every={k}",
        )
        for k in (1, 2, 4)
    }


# slow: the three runs of `every` take 15 s, kept out of the README suite's 5 minutes (CI runs
# the slow set too)
@pytest.mark.slow
def test_sync_gradients_every_divides_the_fsdp_reductions(every, one_device):
    fsdp = {k: _gradient_reductions(report, ["fsdp"]) for k, (_, report, _) in every.items()}
    for losses, _, _ in every.values():
        np.testing.assert_allclose(losses, one_device, rtol=1e-5)
    # k = 4: one reduction of the whole fp32 gradient per step, (8 - 1)/8 of it per device
    # ideally; k = 2: twice that; k = 1 (every micro-batch, XLA's own reduction): 4 times.
    assert _bytes(fsdp[4], "ideal_bytes_per_step") == pytest.approx(7 / 8 * 4 * PARAMS, rel=5e-3)
    assert _bytes(fsdp[2]) == pytest.approx(2 * _bytes(fsdp[4]), rel=1e-3)
    assert _bytes(fsdp[1]) == pytest.approx(4 * _bytes(fsdp[4]), rel=1e-3)


@pytest.mark.slow  # `every`, as above
def test_the_plan_shows_the_unsharded_gradient_buffer(every, tmp_path):
    """The buffer that sync_gradients_every > 1 sums in is one replica's parameters in fp32
    (whole along fsdp; tp would split it), on top of the 1/8 shards of the other gradients."""
    assert [every[k][2]["unsharded_grad_bytes"] for k in (1, 2, 4)] == [0, 4 * PARAMS, 4 * PARAMS]
    assert every[1][2]["grad_bytes"] < 4 * PARAMS / 8 * 1.01
    _, _, plan = _run(tmp_path, "[[4,2],[fsdp,tp]]", "training.sync_gradients_every=2")
    # [[4,2]]: whole along fsdp, split over tp=2 (the norms and the replicated rows aside).
    assert 4 * PARAMS / 2 < plan["unsharded_grad_bytes"] < 4 * PARAMS / 2 * 1.05


# slow: 11 s, kept out of the README suite's 5 minutes (CI runs the slow set too)
@pytest.mark.slow
def test_bf16_reductions_halve_the_bytes(every, tmp_path, one_device):
    """The same reductions (fsdp once per step, dp once) with reduce_dtype=bf16: bf16
    payloads, half the ideal bytes, and losses within bf16's rounding of the gradients."""
    mesh = "[[2,4,1],[dp,fsdp,tp]]"
    results = {
        dtype: _run(
            tmp_path / dtype,
            mesh,
            "training.sync_gradients_every=4",
            f"training.reduce_dtype={dtype}",
        )
        for dtype in ("fp32", "bf16")
    }
    for axes in (["dp"], ["fsdp"]):
        fp32, bf16 = (_gradient_reductions(results[d][1], axes) for d in ("fp32", "bf16"))
        assert {d for c in bf16 for d in c["payload_dtypes"]} == {"bf16"}
        assert _bytes(bf16, "ideal_bytes_per_step") == pytest.approx(
            _bytes(fp32, "ideal_bytes_per_step") / 2, rel=1e-3
        )
    np.testing.assert_allclose(results["fp32"][0], one_device, rtol=1e-5)
    np.testing.assert_allclose(results["bf16"][0], one_device, rtol=1e-4)
