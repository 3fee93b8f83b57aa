"""The GPUs meshtrain can compile for without one (`plan.target`), as XLA's GpuTargetConfig.

XLA compiles for a GPU it cannot see from a description of it: the numbers its cost models and
code generator read (streaming multiprocessors, shared memory and registers per SM, memory size
and bandwidth, L2, clock, compute capability) and the cuDNN version it may call. They come from
NVIDIA's data sheets and CUDA's device properties (cudaGetDeviceProperties) of each GPU; the
cuDNN version is the installed one, as on a GPU host with the same wheels.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.errors import ConfigError
from meshtrain.hardware.accelerators import ACCELERATORS, Accelerator


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as XLA's deviceless compiler needs it; `name` is the value of plan.target and
    of plan.device (meshtrain.hardware.accelerators: peak FLOP/s and memory)."""

    name: str
    device_kind: str  # what jax reports as device_kind on a real one
    sm_count: int
    memory_bytes: int  # as CUDA reports it
    memory_bandwidth: int  # bytes/s
    l2_cache_bytes: int
    clock_ghz: float
    shared_memory_per_sm: int = 233_472  # 228 KiB on Hopper and Blackwell
    shared_memory_per_block_optin: int = 232_448

    @property
    def accelerator(self) -> Accelerator:
        return ACCELERATORS[self.name]

    @property
    def compute_capability(self) -> tuple[int, int]:
        return self.accelerator.compute_capability

    def target_config(self, cudnn_version: int) -> str:
        """XLA's GpuTargetConfig text proto for this GPU with cuDNN `cudnn_version` (92800)."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_sm}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn_version // 10000} minor: {cudnn_version // 100 % 100} }}
device_description_str: "{self.device_kind}"
"""


GPU_SPECS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        # H100 SXM5 80GB: 132 SMs at up to 1.98 GHz, 3.35 TB/s HBM3, 50 MiB L2.
        GpuSpec(
            "h100",
            "NVIDIA H100 80GB HBM3",
            132,
            84_942_979_072,
            3_352_320_000_000,
            52_428_800,
            1.98,
        ),
        # H200 SXM 141GB: the H100's chip with 4.8 TB/s HBM3e.
        GpuSpec(
            "h200",
            "NVIDIA H200",
            132,
            151_397_597_184,
            4_800_000_000_000,
            52_428_800,
            1.98,
        ),
        # B200 180GB: 148 SMs at up to 1.965 GHz, 7.7 TB/s HBM3e, 126.5 MiB L2.
        GpuSpec(
            "b200",
            "NVIDIA B200",
            148,
            191_514_411_008,
            7_672_320_000_000,
            132_644_864,
            1.965,
        ),
    )
}


def gpu_spec(name: str) -> GpuSpec:
    """The GPU `plan.target=name` names; a ConfigError lists the known ones."""
    if name not in GPU_SPECS:
        raise ConfigError(
            f"plan.target={name!r} is not a GPU meshtrain can compile for; use one of: "
            f"{', '.join(GPU_SPECS)}"
        )
    return GPU_SPECS[name]
