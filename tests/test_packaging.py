"""pyproject.toml installs light: `pip install -e .` and the README's `pip install -e '.[test]'`
pull no PyTorch, transformers or NVIDIA libraries (gigabytes on a plain Linux machine); those are
the `parity` extra's, for the slow live comparisons only. tests/conftest.py checks the other half:
a session of the default tests imports neither torch nor transformers."""

import tomllib

from helpers.guards import HEAVY_MODULES
from helpers.paths import REPO
from packaging.requirements import Requirement

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def heavy(requirement: str) -> bool:
    """A requirement that downloads GPU builds or PyTorch: torch, transformers, an nvidia-*
    library, or any package with a CUDA extra (jax[cuda12])."""
    parsed = Requirement(requirement)
    name = parsed.name.lower().replace("_", "-")
    gpu_extra = any(extra.lower().startswith("cuda") for extra in parsed.extras)
    return name in HEAVY_MODULES or name.startswith("nvidia-") or gpu_extra


def test_the_heavy_check_knows_the_names():
    assert heavy("torch>=2.13") and heavy("transformers>=5.17,<6")
    assert heavy("nvidia-cublas-cu12") and heavy("jax[cuda12]>=0.12")
    assert not heavy("jax>=0.12.0") and not heavy("pytest>=8")


def test_core_and_test_dependencies_need_no_torch_or_gpu_libraries():
    core = PROJECT["dependencies"]
    test = PROJECT["optional-dependencies"]["test"]
    assert [r for r in core + test if heavy(r)] == []
    assert {Requirement(r).name for r in core} >= {"jax", "flax", "hydra-core", "rich"}
    assert {Requirement(r).name for r in test} == {
        "pytest",
        "pytest-xdist",
        "ruff",
        "hydra-submitit-launcher",
    }


def test_torch_and_transformers_are_only_in_the_parity_extra():
    extras = PROJECT["optional-dependencies"]
    heavy_by_extra = {
        extra: sorted(Requirement(r).name for r in requirements if heavy(r))
        for extra, requirements in extras.items()
    }
    assert {extra: names for extra, names in heavy_by_extra.items() if names} == {
        "parity": ["torch", "transformers"],
        "gpu-compile": ["jax"],  # jax[cuda12]: JAX's CUDA plugin and NVIDIA's libraries
    }
