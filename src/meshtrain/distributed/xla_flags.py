"""XLA_FLAGS edits that must happen before JAX starts its backend; the standard library only, so
the tests' conftest and the launcher can use it before anything imports JAX.

Faked CPU devices: XLA's CPU runtime aborts the process (exit 42) when the participants of a
collective have not all arrived within 40 s. On faked devices that share a few cores, the
eager, op-by-op ops of a real-size model can keep one participant waiting that long without any
deadlock, so wherever meshtrain fakes CPU devices it raises these limits far beyond any step's
length (CPU_COLLECTIVE_TIMEOUTS). A real deadlock is still reported after the warning time and
stopped after a day.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

# XLA flag → value, for CPU devices faked by meshtrain (and by XLA_FLAGS).
CPU_COLLECTIVE_TIMEOUTS = {
    "xla_cpu_collective_call_warn_stuck_timeout_seconds": "600",
    "xla_cpu_collective_call_terminate_timeout_seconds": "86400",
    "xla_cpu_collective_timeout_seconds": "86400",
}
FAKE_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")


def _flag_name(token: str) -> str:
    return token.lstrip("-").split("=", 1)[0]


def merge_xla_flags(existing: str, defaults: Mapping[str, str]) -> str:
    """`existing` (an XLA_FLAGS value) followed by `--name=value` for each default whose name it
    does not set (with any value, or bare): a flag the user set always wins."""
    named = {_flag_name(t) for t in existing.split() if t.startswith("-")}
    added = [f"--{name}={value}" for name, value in defaults.items() if name not in named]
    return " ".join([existing.strip(), *added]).strip()


def without_fake_device_count(existing: str) -> str:
    """`existing` XLA_FLAGS without its --xla_force_host_platform_device_count, if any."""
    return " ".join(FAKE_DEVICE_COUNT.sub("", existing).split())


def with_cpu_collective_timeouts(existing: str) -> str:
    """`existing` XLA_FLAGS plus CPU_COLLECTIVE_TIMEOUTS, except those it sets itself."""
    return merge_xla_flags(existing, CPU_COLLECTIVE_TIMEOUTS)


def raise_cpu_collective_timeouts(environ: dict[str, str] | os._Environ = os.environ) -> None:
    """Adds CPU_COLLECTIVE_TIMEOUTS to environ["XLA_FLAGS"]; before JAX starts its backend."""
    environ["XLA_FLAGS"] = with_cpu_collective_timeouts(environ.get("XLA_FLAGS", ""))
