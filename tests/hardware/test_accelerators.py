"""The accelerator table: device kinds to names, memory and peak FLOP/s."""

import re

import pytest

from meshtrain.errors import ConfigError
from meshtrain.hardware.accelerators import accelerator_for_kind, accelerator_named


def test_accelerator_table():
    assert accelerator_for_kind("NVIDIA H100 80GB HBM3").name == "h100"
    assert accelerator_for_kind("TPU v5 lite").name == "v5e"
    assert accelerator_for_kind("TPU v5").name == "v5p"
    assert accelerator_for_kind("cpu") is None
    assert accelerator_for_kind("NVIDIA GeForce RTX 4090") is None  # unknown: no MFU
    assert accelerator_named("h200").peak("bf16") == 989e12
    assert accelerator_named("a100_80gb").peak("fp32") == 156e12  # TF32
    with pytest.raises(
        ConfigError, match=re.escape("plan.device='h300' is not a known accelerator")
    ):
        accelerator_named("h300")
