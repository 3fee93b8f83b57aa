"""The memory planner: analytic bytes per device, the verdict, the dry run from the command line,
and a large model planned without the weights ever being in memory."""

import json
import sys

import jax
import pytest
from helpers.config import compose_config
from helpers.process import RUN_TRAINING, run_python
from helpers.tiny_model import F32, MATRIX_PARAMS, NORM_PARAMS

from meshtrain.hardware.accelerators import accelerator_named
from meshtrain.observe.memory_plan import MemoryPlan
from meshtrain.train.dry_run import dry_run
from meshtrain.units import GIB

# AdamW's two step counters (scale_by_adam, scale_by_learning_rate): int32, replicated.
ADAM_COUNTERS = 2 * 4


@pytest.mark.parametrize(
    ("mesh", "micro", "fsdp", "tp"),
    # Pure fsdp is checked with the communication report, in tests/observe/test_communication.py.
    [("[[1,1],[fsdp,tp]]", 8, 1, 1), ("[[4,2],[fsdp,tp]]", 2, 4, 2)],
)
@pytest.mark.slow
def test_param_and_optimizer_bytes_are_analytic(mesh, micro, fsdp, tp, run_dir):
    cfg = compose_config(f"model.mesh_shape={mesh}", f"training.micro_batch_size={micro}")
    plan = dry_run(cfg, run_dir, devices=jax.devices()[: fsdp * tp])
    # Weight matrices are split over fsdp (embed) and tp (heads, mlp, vocab); norms replicated.
    params = F32 * (MATRIX_PARAMS // (fsdp * tp) + NORM_PARAMS)
    assert plan.params_bytes == params
    assert plan.grad_bytes == params
    assert plan.opt_state_bytes == 2 * params + ADAM_COUNTERS  # Adam's mu and nu
    written = json.loads((run_dir / "plan.json").read_text())
    assert written["params_bytes"] == params
    assert written["opt_state_bytes"] == 2 * params + ADAM_COUNTERS
    # XLA's own accounting of the step's arguments holds the same state, plus the int32 step
    # counter, the uint32[2] RNG key, the non-finite record (4 scalars) and the batch of int32
    # tokens [1, micro × fsdp, 129] split over fsdp.
    batch = 4 * micro * 129
    small_state = 4 + 2 * 4 + 4 * 4
    assert plan.argument_bytes == params + plan.opt_state_bytes + small_state + batch
    assert plan.activation_bytes > 0
    assert written["total_bytes"] == plan.total_bytes
    assert not (run_dir / "metrics.jsonl").exists()  # a dry run trains nothing


def plan_with(**changes) -> MemoryPlan:
    values = dict(
        mesh={"dp": 1, "fsdp": 8, "tp": 1},
        micro_batch_size=4,
        params_bytes=2 * GIB,
        opt_state_bytes=4 * GIB,
        grad_bytes=2 * GIB,
        activation_bytes=10 * GIB,
        argument_bytes=6 * GIB,
        output_bytes=6 * GIB,
        alias_bytes=6 * GIB,
        collective_bytes_per_step=1e9,
        flops_per_step=1e15,
    )
    return MemoryPlan(**{**values, **changes})


def test_verdict_fits():
    v5e = accelerator_named("v5e")
    plan = plan_with(device="v5e", capacity_bytes=v5e.memory_gib * GIB * 0.9)
    assert plan.total_bytes == 16 * GIB
    assert plan.fits is False  # 16 GiB on a 16 GiB chip with 10% kept free
    lines = plan.format()
    assert (
        "verdict: does not fit on v5e by 1.60 GiB: needs 16.00 GiB of 14.40 GiB usable"
        in "\n".join(lines)
    )
    # Activations are the larger part, so the micro-batch lever comes first.
    assert lines[-2].startswith("  try: a smaller micro-batch (training.micro_batch_size=2 with")
    assert lines[-1].startswith(
        "  try: more fsdp (fsdp=8 → 16 in model.mesh_shape halves the 8.00 GiB"
    )
    one = plan_with(micro_batch_size=1, device="v5e", capacity_bytes=GIB).format()
    assert one[-2] == (
        "  try: shorter sequences (data.seq_len; the micro-batch is 1 already) or remat "
        "(model.remat=full with model.scan_layers=true): shrinks the 10.00 GiB of activations "
        "and temporaries"
    )
    remat = plan_with(micro_batch_size=1, remat="full", scan_layers=True, capacity_bytes=GIB)
    assert "remat" not in remat.format()[-2]  # already on: not suggested again
    h100 = plan_with(device="h100", capacity_bytes=accelerator_named("h100").memory_gib * GIB * 0.9)
    assert h100.fits is True
    assert "verdict: fits on h100: 16.00 GiB of 71.64 GiB usable" in h100.format()[-1]
    assert plan_with().fits is None and "no memory size known" in plan_with().format()[-1]


def test_a_run_logs_one_line_where_no_device_memory_size_is_known():
    unknown = plan_with()
    assert unknown.log_lines(dry_run=False) == [
        "memory plan per device: 16.00 GiB in all (parameters 2.00 GiB, optimizer state "
        "4.00 GiB, activations + temps 10.00 GiB); set plan.device=h100 (or h200, a100_80gb, "
        "b200, v5e...) to check it against a device; the full table is in plan.json"
    ]
    # A dry run and a known device memory size (GPU, TPU, plan.device) keep the whole table.
    assert unknown.log_lines(dry_run=True) == unknown.format()
    assert len(unknown.format()) == 9
    h100 = plan_with(device="h100", capacity_bytes=accelerator_named("h100").memory_gib * GIB * 0.9)
    assert h100.log_lines(dry_run=False) == h100.format()
    assert h100.format()[0] == "memory plan per device (mesh dp=1, fsdp=8, tp=1):"
    # The rows of costs a config chose stay under the one line.
    replicated = plan_with(replicated_kv_bytes=GIB // 2, replicated_kv_over=2)
    assert replicated.log_lines(dry_run=False)[1:] == [
        "    key/value, whole    512.00 MiB   (replicated over tp=2: 256.00 MiB more than a 1/tp "
        "split, as much again in gradients and in each Adam moment)"
    ]


# docs/planning.md's error example (tests/docs/test_profiling_docs.py) covers an unknown plan.device.


@pytest.mark.slow
def test_a_large_model_plans_without_its_weights_in_memory(tmp_path):
    """Gemma 3 27B on two nodes of 8 (faked) devices: the real step compiles while the process
    holds a small fraction of the 108 GB of fp32 weights (this machine has 24 GB)."""
    command = [
        sys.executable,
        str(RUN_TRAINING),
        "model=gemma3_27b",
        'model.mesh_shape=[[8,2],["fsdp","tp"]]',
        "model.remat=full",
        "model.scan_layers=true",
        "training.dry_run=true",
        "plan.fake_devices=16",
        "plan.device=h100",
        "training.micro_batch_size=1",
        f"hydra.run.dir={tmp_path}",
    ]
    # A parent that only runs the child reports the child's peak resident memory.
    measure = (
        "import resource, subprocess, sys; "
        f"code = subprocess.run({command!r}).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(code)"
    )
    result = run_python("-c", measure, devices=1, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    peak_rss = int(result.stdout.strip().splitlines()[-1])
    plan = json.loads((tmp_path / "plan.json").read_text())
    # 62 layers × (4 norms of d_model=5376 + q and k norms of head_dim=128) + the final norm are
    # replicated; every matrix is split 16 ways (fsdp over embed, tp over heads, mlp and vocab).
    num_params, norms = 27_009_346_304, 62 * (4 * 5376 + 2 * 128) + 5376
    weights = num_params * F32
    assert plan["params_bytes"] == F32 * ((num_params - norms) // 16 + norms)
    assert plan["opt_state_bytes"] == 2 * plan["params_bytes"] + ADAM_COUNTERS
    assert peak_rss < 0.05 * weights, f"peak RSS {peak_rss / GIB:.2f} GiB"
    assert plan["fits"] is True  # 32.9 GiB of an H100's 71.6 usable, with remat


@pytest.mark.slow
def test_lora_plans_the_frozen_base_at_its_storage_and_what_it_saves(run_dir):
    """On fsdp=4 × tp=2: the adapters and their two moments as trainable state; the nf4 base as
    0.5 byte per projection weight plus an fp32 absmax per block of 16, the embedding and norms
    in fp32; and full fine-tuning's 16 bytes per parameter beside it."""
    lora = ("model.lora.rank=4", "model.lora.targets=[q,k,v,o,gate,up,down]")
    cfg = compose_config(
        "model.mesh_shape=[[4,2],[fsdp,tp]]",
        "training.micro_batch_size=2",
        *lora,
        "model.lora.base_dtype=nf4",
        "model.lora.quant_block=16",
    )
    plan = dry_run(cfg, run_dir, devices=jax.devices()[:8])
    projections = MATRIX_PARAMS - 384 * 128  # every weight but the embedding: all quantised
    nf4 = projections // 2 + 4 * projections // 16
    assert plan.frozen_bytes == (nf4 + 4 * 384 * 128) // 8 + F32 * NORM_PARAMS
    # Full fine-tuning: weights, gradients and two moments of every parameter (the adapters'
    # share per device is the plan's parameters).
    every = F32 * (MATRIX_PARAMS // 8 + NORM_PARAMS) + plan.params_bytes
    assert plan.lora["full_finetune_state_bytes"] == 4 * every
    assert plan.lora["lora_state_bytes"] == plan.frozen_bytes + 2 * plan.params_bytes + (
        plan.opt_state_bytes
    )
    full = dry_run(
        compose_config("model.mesh_shape=[[4,2],[fsdp,tp]]", "training.micro_batch_size=2"),
        run_dir / "full",
        devices=jax.devices()[:8],
    )
    state = lambda p: p.params_bytes + p.grad_bytes + p.opt_state_bytes + p.frozen_bytes  # noqa: E731
    # The tiny model's embedding is half its weights and stays fp32: 2.6× less state here.
    assert state(full) / state(plan) >= 2.5
    assert full.argument_bytes - plan.argument_bytes >= 0.9 * (
        full.params_bytes
        + full.opt_state_bytes
        - plan.frozen_bytes
        - plan.params_bytes
        - plan.opt_state_bytes
    )
    assert "frozen base" in " ".join(plan.format())
