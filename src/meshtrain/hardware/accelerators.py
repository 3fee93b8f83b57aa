"""Published peak matmul throughput and memory of the accelerators meshtrain knows by name.

One table feeds both MFU (peak FLOP/s of the devices a run uses, found by `device.device_kind`)
and the planner's verdict (`plan.device=h100`: memory per device). Peaks are dense (no 2:4
sparsity) per chip, from the vendors' data sheets: NVIDIA H100/H200
(https://www.nvidia.com/en-us/data-center/h100/, .../h200/), A100 (.../a100/) and HGX B200
(.../hgx/) quote bf16 and TF32 "with sparsity", twice the dense rate used here; Google Cloud TPU
system architecture pages (https://cloud.google.com/tpu/docs/system-architecture-tpu-vm) for
v4, v5e, v5p and v6e.

`peak_fp32` is the rate at which XLA runs *fp32* matmuls at JAX's default precision: TF32 tensor
cores on NVIDIA Ampere and later, one bf16 pass on TPU (so the bf16 peak). An fp32 run's MFU is
measured against it, a bf16 run's against `peak_bf16`.

Memory is what the device reports to JAX (GiB), a little under the marketed size.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.errors import ConfigError


@dataclass(frozen=True)
class Accelerator:
    name: str  # the value of plan.device
    description: str
    device_kinds: tuple[str, ...]  # jax `device.device_kind` strings, compared lower-case
    peak_bf16: float  # dense FLOP/s per chip
    peak_fp32: float  # FLOP/s per chip of an fp32 matmul at JAX's default precision
    memory_gib: float  # per chip
    compute_capability: tuple[int, int] | None = None  # NVIDIA GPUs: what kernels it can run

    def peak(self, compute_dtype: str) -> float:
        return self.peak_bf16 if compute_dtype == "bf16" else self.peak_fp32


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            "h100", "NVIDIA H100 SXM 80GB", ("nvidia h100 80gb hbm3",), 989e12, 495e12, 79.6, (9, 0)
        ),
        Accelerator(
            "h100_pcie",
            "NVIDIA H100 PCIe 80GB",
            ("nvidia h100 pcie",),
            756e12,
            378e12,
            79.6,
            (9, 0),
        ),
        Accelerator(
            "h200", "NVIDIA H200 SXM 141GB", ("nvidia h200",), 989e12, 495e12, 140.4, (9, 0)
        ),
        Accelerator(
            "a100_40gb",
            "NVIDIA A100 40GB (SXM or PCIe)",
            ("nvidia a100-sxm4-40gb", "nvidia a100-pcie-40gb"),
            312e12,
            156e12,
            39.6,
            (8, 0),
        ),
        Accelerator(
            "a100_80gb",
            "NVIDIA A100 80GB (SXM or PCIe)",
            ("nvidia a100-sxm4-80gb", "nvidia a100 80gb pcie"),
            312e12,
            156e12,
            79.2,
            (8, 0),
        ),
        Accelerator(
            "b200", "NVIDIA B200 180GB", ("nvidia b200",), 2250e12, 1100e12, 179.0, (10, 0)
        ),
        # The common 24 GB card of single-GPU fine-tuning (dense bf16 tensor rate).
        Accelerator("l4", "NVIDIA L4 24GB", ("nvidia l4",), 121e12, 30.3e12, 22.5, (8, 9)),
        Accelerator("v4", "Google TPU v4", ("tpu v4",), 275e12, 275e12, 32.0),
        Accelerator("v5e", "Google TPU v5e", ("tpu v5 lite", "tpu v5e"), 197e12, 197e12, 16.0),
        Accelerator("v5p", "Google TPU v5p", ("tpu v5", "tpu v5p"), 459e12, 459e12, 95.0),
        Accelerator(
            "v6e", "Google TPU v6e (Trillium)", ("tpu v6 lite", "tpu v6e"), 918e12, 918e12, 32.0
        ),
    )
}


def accelerator_named(name: str) -> Accelerator:
    """The accelerator `plan.device=name` refers to; a ConfigError lists the known names."""
    if name not in ACCELERATORS:
        raise ConfigError(
            f"plan.device={name!r} is not a known accelerator; use one of: {', '.join(ACCELERATORS)}"
        )
    return ACCELERATORS[name]


def accelerator_for_kind(device_kind: str) -> Accelerator | None:
    """The table entry for a jax device_kind, or None for a device we have no data for."""
    kind = device_kind.strip().lower()
    for accelerator in ACCELERATORS.values():
        if kind in accelerator.device_kinds:
            return accelerator
    return None
