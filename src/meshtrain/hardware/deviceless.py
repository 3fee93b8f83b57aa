"""Devices of a GPU this host lacks, for compiling a program that will run on it.

`target_devices` asks JAX's CUDA plugin for a topology of `plan.target` GPUs (nodes of up to 8)
from XLA's description of the GPU (targets.gpu_specs). A mesh built over those devices compiles
real GPU code (Triton fusions, cuDNN calls, NCCL collectives) on a CPU host: there is no
autotuning, and nothing runs. `jax_cudnn_checks_answer_for` makes JAX's cuDNN attention, which
asks the local device for its compute capability, answer for the target instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from meshtrain.errors import ConfigError
from meshtrain.hardware.gpu_specs import GpuSpec
from meshtrain.hardware.target import TargetDevice, cudnn_version

GPUS_PER_NODE = 8
INSTALL_HINT = "pip install -e '.[gpu-compile]' (JAX's CUDA plugin and its NVIDIA libraries)"


def mesh_device_count(mesh_shape: Any, target: str) -> int:
    """The number of GPUs model.mesh_shape names (every size given: nothing to infer from)."""
    sizes = list(mesh_shape[0])
    if any(size == -1 for size in sizes):
        raise ConfigError(
            f"plan.target={target} compiles for exactly the GPUs model.mesh_shape names; "
            f"replace -1 in {sizes} by a size"
        )
    return math.prod(sizes)


def topology_name(count: int, target: str) -> str:
    """JAX's topology string (slices x hosts x devices per host) for `count` GPUs."""
    if count <= GPUS_PER_NODE:
        return f"1x1x{count}"
    if count % GPUS_PER_NODE:
        raise ConfigError(
            f"plan.target={target}: {count} GPUs do not fill nodes of {GPUS_PER_NODE}; "
            f"use a multiple of {GPUS_PER_NODE} devices in model.mesh_shape"
        )
    return f"1x{count // GPUS_PER_NODE}x{GPUS_PER_NODE}"


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA 12 plugin is importable (find_spec raises, not answers None, when no
    plugin at all put the jax_plugins package there)."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


def target_devices(spec: GpuSpec, count: int) -> Sequence[jax.Device]:
    """`count` devices of GPU `spec`, in nodes of up to GPUS_PER_NODE, for compiling only."""
    version = cudnn_version()
    if not cuda_plugin_installed() or version is None:
        raise ConfigError(
            f"plan.target={spec.name} compiles with JAX's CUDA plugin, which is not installed: "
            f"{INSTALL_HINT}"
        )
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda",
        target_config=spec.target_config(version),
        topology=topology_name(count, spec.name),
    )
    return list(topology.devices)


@contextlib.contextmanager
def jax_cudnn_checks_answer_for(target: TargetDevice) -> Iterator[None]:
    """While compiling for `target` from a host without it: JAX's cuDNN attention checks
    (jax._src.cudnn.fused_attention_stablehlo) read the compute capability of the local GPU
    and would refuse Hopper's head_dim 256 on a CPU host; they read `target`'s instead."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    capability = target.compute_capability or (0, 0)

    def parse(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("."))

    replacements = {
        "check_compute_capability": lambda wanted: capability >= parse(wanted),
        "is_cuda_compute_capability_equal": lambda wanted: capability == parse(wanted),
    }
    saved = {name: getattr(cudnn_attention, name) for name in replacements}
    for name, replacement in replacements.items():
        setattr(cudnn_attention, name, replacement)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(cudnn_attention, name, original)
