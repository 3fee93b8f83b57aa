"""The kind of device a program is compiled for, which need not be this host's.

A program compiled for a GPU topology from a CPU host (`plan.target`, meshtrain.hardware) must be
the program a GPU host would compile: every choice made by platform (the attention kernel, the
CPU-only barrier of the projections' backward pass) asks `target_device()`, which reads the
device of the mesh being compiled for (jax.set_mesh), never `jax.devices()` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from meshtrain.hardware.accelerators import accelerator_for_kind


@dataclass(frozen=True)
class TargetDevice:
    """What a compiled program runs on: `platform` is jax's ("cpu", "gpu", "tpu"), `device_kind`
    jax's device_kind ("NVIDIA H100 80GB HBM3"), `compute_capability` (major, minor) of an
    NVIDIA GPU, None elsewhere or when unknown."""

    platform: str
    device_kind: str
    compute_capability: tuple[int, int] | None = None

    @property
    def nvidia_gpu(self) -> bool:
        return self.platform == "gpu" and (
            self.compute_capability is not None or "nvidia" in self.device_kind.lower()
        )

    def describe(self) -> str:
        return self.device_kind if self.platform == "gpu" else self.platform


def cudnn_version() -> int | None:
    """The cuDNN version JAX's CUDA plugin loads (9.28.0 → 92800); None without the plugin."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except RuntimeError:
        return None


def _capability(text: str | None) -> tuple[int, int] | None:
    """'9.0' → (9, 0); None for anything else (a ROCm device's 'gfx90a')."""
    major, _, minor = str(text or "").partition(".")
    if not (major.isdigit() and (minor or "0").isdigit()):
        return None
    return int(major), int(minor or 0)


def _known_capability(device_kind: str) -> tuple[int, int] | None:
    """A device kind's compute capability: meshtrain's table, else a local device of that kind."""
    accelerator = accelerator_for_kind(device_kind)
    if accelerator is not None and accelerator.compute_capability is not None:
        return accelerator.compute_capability
    for device in jax.local_devices():
        if device.device_kind == device_kind:
            return _capability(getattr(device, "compute_capability", None))
    return None


def device_target(device: jax.Device) -> TargetDevice:
    """The TargetDevice of a concrete device (a local one, or a GPU topology's)."""
    capability = None
    if device.platform == "gpu":
        version = str(getattr(getattr(device, "client", None), "platform_version", ""))
        if "cuda" in version.lower() or "nvidia" in device.device_kind.lower():
            capability = _capability(getattr(device, "compute_capability", None))
    return TargetDevice(device.platform, device.device_kind, capability)


def target_device(device: jax.Device | None = None) -> TargetDevice:
    """The device a program is compiled for: `device` if given; inside jax.set_mesh, the mesh's
    devices (those of a GPU topology when compiling for one from a CPU host); else this
    process's first device."""
    if device is not None:
        return device_target(device)
    mesh = jax.sharding.get_abstract_mesh()
    abstract = None if mesh.empty else mesh.abstract_device
    if abstract is None:
        return device_target(jax.devices()[0])
    kind = abstract.device_kind
    capability = _known_capability(kind) if abstract.platform == "gpu" else None
    return TargetDevice(abstract.platform, kind, capability)
