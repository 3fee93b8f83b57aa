"""Collective accounting of the compiled train step against bytes derived from the parameters."""

import json

import jax
import pytest
from helpers.config import compose_config
from helpers.tiny_model import F32, MATRIX_PARAMS, NORM_PARAMS

from meshtrain.observe.communication import account_collectives
from meshtrain.train.dry_run import dry_run


def communication(tmp_path_factory, mesh: str, micro: int, accum: int, *extra: str) -> dict:
    cfg = compose_config(
        f"model.mesh_shape={mesh}",
        f"training.micro_batch_size={micro}",
        f"training.gradient_accumulation_steps={accum}",
        "training.profile_communication=true",
        "data=synthetic",
        *extra,
    )
    run_dir = tmp_path_factory.mktemp("comm")
    dry_run(cfg, run_dir)
    report = json.loads((run_dir / "communication.json").read_text())
    report["plan"] = json.loads((run_dir / "plan.json").read_text())
    return report


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return communication(tmp_path_factory, "[[8,1],[fsdp,tp]]", 1, 1)


@pytest.fixture(scope="module")
def fsdp_bf16(tmp_path_factory):
    return communication(
        tmp_path_factory, "[[8,1],[fsdp,tp]]", 1, 1, "training.mixed_precision=bf16"
    )


@pytest.fixture(scope="module")
def fsdp_accumulating(tmp_path_factory):
    return communication(tmp_path_factory, "[[8,1],[fsdp,tp]]", 1, 2)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return communication(tmp_path_factory, "[[4,2],[fsdp,tp]]", 2, 1)


def total(report, field, *, kinds, axes=("fsdp",), dtype="f32"):
    return sum(
        c[field]
        for c in report["collectives"]
        if c["kind"] in kinds and tuple(c["mesh_axes"]) == axes and c["dtypes"] == [dtype]
    )


@pytest.mark.slow
def test_fsdp_parameter_all_gather_matches_the_parameter_count(fsdp):
    n = 8
    # Each device gathers the other (N-1)/N of every sharded fp32 weight, once per step.
    expected = (n - 1) / n * F32 * MATRIX_PARAMS
    gathered = total(fsdp, "ring_bytes_per_step", kinds={"all-gather"})
    assert gathered == pytest.approx(expected, rel=0.05)
    assert all(
        c["group_size"] == n and c["whole_axes"]
        for c in fsdp["collectives"]
        if c["kind"] == "all-gather"
    )


@pytest.mark.slow
def test_bf16_weights_are_cast_before_the_fsdp_all_gather(fsdp, fsdp_bf16):
    """bf16 runs cast each weight on its own shard, so the gather carries bf16: half the bytes.
    XLA's CPU backend widens bf16 collectives to f32, so there the halving shows in the ideal
    bytes and the payload dtype (GPU and TPU gather in bf16)."""
    fp32 = total(fsdp, "ring_bytes_per_step", kinds={"all-gather"})
    gathers = [
        c for c in fsdp_bf16["collectives"] if c["kind"] == "all-gather" and c["dtypes"] == ["f32"]
    ]
    assert gathers and all(c["payload_dtypes"] == ["bf16"] for c in gathers)
    ideal = sum(c["ideal_bytes"] * c["count"] for c in gathers)
    assert ideal == pytest.approx(fp32 / 2, rel=0.01)
    assert all(c["payload_dtypes"] == c["dtypes"] for c in fsdp["collectives"])


@pytest.mark.parametrize("precision", ["fsdp", pytest.param("fsdp_bf16", marks=pytest.mark.slow)])
def test_fsdp_gradient_reduction_matches_under_the_compiled_collective(precision, request):
    fsdp = request.getfixturevalue(precision)
    n = 8
    sharded, replicated = F32 * MATRIX_PARAMS, F32 * NORM_PARAMS
    reduced = [
        c
        for c in fsdp["collectives"]
        if c["kind"] in ("all-reduce", "reduce-scatter") and c["mesh_axes"] == ["fsdp"]
    ]
    ring = sum(c["ring_bytes_per_step"] for c in reduced)
    ideal = sum(c["ideal_bytes"] * c["count"] for c in reduced)
    # An ideal lowering reduce-scatters the sharded gradients and all-reduces the replicated ones.
    assert ideal == pytest.approx((n - 1) / n * sharded + 2 * (n - 1) / n * replicated, rel=0.05)
    if any(c["kind"] == "reduce-scatter" for c in reduced):  # GPU, TPU
        assert ring == pytest.approx(ideal, rel=0.05)
    else:  # the CPU backend: all-reduce of the whole gradient, then each device slices its shard
        assert ring == pytest.approx(2 * (n - 1) / n * (sharded + replicated), rel=0.05)
        assert any(c["ideal_kind"] == "reduce-scatter" for c in reduced)


@pytest.mark.slow
def test_accumulation_reduces_gradients_once_per_micro_batch(fsdp, fsdp_accumulating):
    """The gradient reduction sits inside the accumulation scan: twice the bytes for 2 steps."""
    once = total(fsdp, "ring_bytes_per_step", kinds={"all-reduce", "reduce-scatter"})
    twice = total(fsdp_accumulating, "ring_bytes_per_step", kinds={"all-reduce", "reduce-scatter"})
    assert twice == pytest.approx(2 * once, rel=0.01)
    in_loop = [c for c in fsdp_accumulating["collectives"] if c["count"] == 2]
    assert in_loop and all(c["trip_count_known"] for c in fsdp_accumulating["collectives"])


def test_plan_state_bytes_are_analytic(fsdp):
    params = F32 * (MATRIX_PARAMS // 8 + NORM_PARAMS)  # weights over fsdp=8, norms replicated
    assert fsdp["plan"]["params_bytes"] == fsdp["plan"]["grad_bytes"] == params
    assert fsdp["plan"]["opt_state_bytes"] == 2 * params + 2 * 4  # mu, nu and 2 int32 counters


def test_plan_collective_bytes_are_the_report_total(fsdp):
    assert fsdp["plan"]["collective_bytes_per_step"] == pytest.approx(
        fsdp["bytes_per_device_per_step"]["ring"]
    )
    assert fsdp["bytes_per_device_per_step"]["ideal"] < fsdp["bytes_per_device_per_step"]["ring"]


@pytest.mark.slow
def test_hybrid_mesh_axes(hybrid):
    fsdp_size, tp_size = 4, 2
    weights = [
        c for c in hybrid["collectives"] if c["kind"] == "all-gather" and c["dtypes"] == ["f32"]
    ]
    assert weights and all(
        c["mesh_axes"] == ["fsdp"] and c["group_size"] == fsdp_size for c in weights
    )
    # With tp=2 each device gathers only its tp half of each weight.
    expected = (fsdp_size - 1) / fsdp_size * F32 * MATRIX_PARAMS / tp_size
    assert sum(c["ring_bytes_per_step"] for c in weights) == pytest.approx(expected, rel=0.05)
    # Megatron-style tp sums partial activations across the tp pair in every block.
    tp_reduces = [
        c for c in hybrid["collectives"] if c["kind"] == "all-reduce" and c["mesh_axes"] == ["tp"]
    ]
    assert len(tp_reduces) >= 4 and all(c["group_size"] == tp_size for c in tp_reduces)
    rows = {(r["kind"], r["mesh_axes"]) for r in hybrid["summary"]}
    assert ("all-gather", "fsdp") in rows and ("all-reduce", "tp") in rows


# GPU-style asynchronous collectives in a loop of 3 iterations: an all-gather-start/done pair
# and a reduce-scatter wrapped in async-start/done.
ASYNC_HLO = """HloModule jit_step, entry_computation_layout={(f32[4,16]{1,0})->f32[4,16]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%async_rs (p0: f32[32,16]) -> f32[4,16] {
  %p0 = f32[32,16]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = f32[4,16]{1,0} reduce-scatter(%p0), channel_id=2, replica_groups=[1,8]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%add
}

%body (state: (s32[], f32[4,16])) -> (s32[], f32[4,16]) {
  %state = (s32[], f32[4,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %w = f32[4,16]{1,0} get-tuple-element(%state), index=1
  %all-gather-start.1 = (f32[4,16]{1,0}, f32[32,16]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %all-gather-done.1 = f32[32,16]{1,0} all-gather-done(%all-gather-start.1)
  %rs-start = ((f32[32,16]{1,0}), f32[4,16]{1,0}) async-start(%all-gather-done.1), calls=%async_rs
  %rs-done = f32[4,16]{1,0} async-done(%rs-start), calls=%async_rs
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[4,16]{1,0}) tuple(%next, %rs-done)
}

%cond (state.1: (s32[], f32[4,16])) -> pred[] {
  %state.1 = (s32[], f32[4,16]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%state.1), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %three), direction=LT
}

ENTRY %main (a: f32[4,16]) -> f32[4,16] {
  %a = f32[4,16]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,16]{1,0}) tuple(%zero, %a)
  %loop = (s32[], f32[4,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %result = f32[4,16]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_async_collectives_count_once_per_iteration():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    report = account_collectives(ASYNC_HLO, mesh)
    by_kind = {c.kind: c for c in report.collectives}
    assert sorted(by_kind) == ["all-gather", "reduce-scatter"]
    gather, scatter = by_kind["all-gather"], by_kind["reduce-scatter"]
    assert gather.count == scatter.count == 3  # the async-done does not run it a second time
    # all-gather: 7 of 8 shards of f32[32,16] arrive; reduce-scatter: 7/8 of f32[32,16] leave.
    assert gather.ring_bytes == gather.ideal_bytes == 7 * 4 * 16 * 4
    assert scatter.ring_bytes == scatter.ideal_bytes == 7 / 8 * 32 * 16 * 4
    assert gather.mesh_axes == scatter.mesh_axes == ["fsdp"]
    assert report.ring_bytes_per_step == 3 * (1792 + 1792)
