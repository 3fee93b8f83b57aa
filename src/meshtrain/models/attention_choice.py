"""Which attention kernel runs: `model.attention` (auto, xla or cudnn) turned into one of the
kernels of meshtrain.models.attention, once per model and compute dtype, with the reason.

`auto` picks cudnn on an NVIDIA GPU in bf16/fp16 when the head dimension allows it (a multiple
of 8, ≤ 256 on Hopper and Blackwell with a recent cuDNN, ≤ 128 elsewhere: cudnn_head_dim_limit),
and chunked otherwise, also wherever the sequence is split over cp (cuDNN's causal mask cannot
offset a chunk's queries). The GPU is the one the program is compiled for
(meshtrain.hardware.target), so a GPU program compiled from a CPU host picks what a GPU host
would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.config.schema import AttentionImpl
from meshtrain.errors import ConfigError
from meshtrain.hardware.target import TargetDevice, cudnn_version, target_device
from meshtrain.models.attention import AttentionKernel

_HALF_PRECISION = (jnp.bfloat16, jnp.float16)


def cudnn_head_dim_limit(target: TargetDevice, version: int | None) -> int:
    """The largest head_dim cuDNN's flash attention trains (forward and backward) on `target`:

    - 256 on Hopper (compute capability 9.x) with cuDNN >= 9.13: JAX's own check allows 256
      there (jax._src.cudnn, check_is_flash_attention), and cuDNN 9.11 and 9.12 mis-checked
      large head dims in Hopper's backward pass (cudnn-frontend 1.14.1 release notes);
    - 256 on Blackwell (10.x and later) with cuDNN >= 9.23, the first with a d=256 backward
      kernel there (cudnn-frontend 1.24.1 release notes);
    - 128 everywhere else (Ampere, Ada, older cuDNN, or a version that cannot be read).
    """
    capability = target.compute_capability
    if capability is None or version is None:
        return 128
    if capability[0] == 9 and version >= 91300:
        return 256
    if capability[0] >= 10 and version >= 92300:
        return 256
    return 128


def check_attention(
    requested: str, device: jax.Device | None = None, context_shards: int = 1
) -> None:
    """Start-up check of model.attention against the devices (cudnn needs an NVIDIA GPU) and
    the mesh (cudnn cannot run the chunks of a sequence split over cp)."""
    if requested == "cudnn" and context_shards > 1:
        raise ConfigError(
            f"model.attention=cudnn cannot attend across a sequence split over cp="
            f"{context_shards} (cuDNN's causal mask cannot offset a chunk's queries); use "
            "model.attention=auto (the chunked kernel) or xla"
        )
    if requested == "cudnn" and not target_device(device).nvidia_gpu:
        raise ConfigError("model.attention=cudnn needs an NVIDIA GPU; use auto or xla")


def cudnn_unsupported(
    dtype: jnp.dtype, head_dim: int, target: TargetDevice, version: int | None
) -> str | None:
    """Why cuDNN's flash attention cannot run these shapes on `target` with cuDNN `version`
    (None: it can)."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _HALF_PRECISION]:
        return (
            f"cuDNN flash attention needs bf16/fp16, the compute dtype is {jnp.dtype(dtype).name}"
        )
    limit = cudnn_head_dim_limit(target, version)
    if head_dim > limit or head_dim % 8:
        shown = "unknown" if version is None else f"{version // 10000}.{version // 100 % 100}"
        return (
            f"cuDNN {shown} on {target.describe()} needs head_dim <= {limit} and a multiple "
            f"of 8, got {head_dim}"
        )
    return None


def select_attention(
    requested: AttentionImpl | str,
    *,
    dtype: jnp.dtype,
    head_dim: int,
    device: jax.Device | None = None,
    context_shards: int = 1,
) -> tuple[AttentionKernel, str]:
    """(kernel, why) for model.attention=`requested` in this compute dtype on the device the
    program is compiled for (`device`, else parallel.target.target_device()), with sequences
    split over `context_shards` cp devices (cuDNN's causal mask cannot offset a chunk's
    queries: chunked instead, see models.context_attention)."""
    if requested == "xla":
        return "xla", "model.attention=xla"
    if requested == "cudnn":
        check_attention(requested, device, context_shards)
        return "cudnn", "model.attention=cudnn"
    if context_shards > 1:
        return (
            "chunked",
            f"auto: cp={context_shards}, where cuDNN's causal mask cannot offset a chunk's queries",
        )
    target = target_device(device)
    if not target.nvidia_gpu:
        return "chunked", f"auto: cuDNN needs an NVIDIA GPU, this is {target.describe()}"
    version = cudnn_version()
    reason = cudnn_unsupported(dtype, head_dim, target, version)
    if reason is not None:
        return "chunked", f"auto: {reason}"
    return "cudnn", f"auto: {target.describe()}, {jnp.dtype(dtype).name}, head_dim {head_dim}"
