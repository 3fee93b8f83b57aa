"""plan.target names a GPU meshtrain can describe to XLA; everything else is refused in one line
before JAX starts."""

import pytest
from helpers.config import compose_config

from meshtrain.config.validate import check_config
from meshtrain.errors import ConfigError
from meshtrain.hardware.accelerators import ACCELERATORS
from meshtrain.hardware.gpu_specs import GPU_SPECS, gpu_spec


def test_each_target_is_a_known_accelerator_of_the_same_kind_and_memory():
    """A target's device kind is the one MFU and plan.device look up, and its memory is what
    the accelerator table says (within the rounding of the table's GiB)."""
    for name, spec in GPU_SPECS.items():
        accelerator = ACCELERATORS[name]
        assert spec.device_kind.lower() in accelerator.device_kinds
        assert abs(spec.memory_bytes / 2**30 - accelerator.memory_gib) < 1.0, name


def test_the_target_config_names_the_gpu_and_the_installed_cudnn():
    text = gpu_spec("h100").target_config(92800)
    assert "core_count: 132" in text
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert "device_memory_size: 84942979072" in text
    assert "dnn_version_info { major: 9 minor: 28 }" in text
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in text
    assert "major: 10 minor: 0" in gpu_spec("b200").target_config(92300)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("plan.target=a100",),
            "plan.target='a100' is not a GPU meshtrain can compile for; use one of: h100, h200, b200",
        ),
        (
            ("plan.target=h100",),
            "plan.target=h100 compiles for GPUs this host lacks, so nothing can run: "
            "add training.dry_run=true",
        ),
        (
            ("plan.target=h100", "training.dry_run=true", "plan.fake_devices=8"),
            "plan.target=h100 compiles for h100 devices, not faked CPU ones: drop "
            "plan.fake_devices",
        ),
    ],
)
def test_bad_targets_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as error:
        check_config(compose_config(*overrides))
    assert str(error.value) == message
