"""configs/model/*.yaml are the published models exactly: each resolved config (the YAML over
the schema's defaults) agrees field by field with the published config.json (kept in
tests/hf_configs/), and builds as many parameters as transformers' own model built from that
config.json (tests/fixtures/hf/parameter_counts.json, recomputed by tests/hf/test_interop_live.py)
and as the table in docs/models.md says."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from helpers.config import CONFIG_DIR, HF_CONFIGS, REPO, compose_config
from helpers.tiny_hf import FIXTURES

from meshtrain.config.validate import check_against_mesh, check_config
from meshtrain.errors import ConfigError
from meshtrain.hf.config_json import architecture_from_hf, check_matches
from meshtrain.models.transformer import parameter_count
from meshtrain.parallel.mesh import parse_mesh_shape

NAMES = sorted(
    p.stem for p in (CONFIG_DIR / "model").glob("*.yaml") if not p.stem.startswith("tiny")
)
PUBLISHED = HF_CONFIGS


def _published(name: str) -> dict:
    return json.loads((PUBLISHED / f"{name}.json").read_text())


def test_every_family_config_has_its_published_config_json():
    assert {p.stem for p in PUBLISHED.glob("*.json")} == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_config_is_the_published_config_json(name):
    cfg = compose_config(f"model={name}")
    check_config(cfg)
    hf = _published(name)
    check_matches(cfg.model, hf, f"{name}.json")
    # Reading the published file gives back exactly what the YAML says.
    architecture = architecture_from_hf(hf)
    experts = architecture.pop("moe", {})  # a mixture of experts' architecture keys
    assert architecture == {key: getattr(cfg.model, key) for key in architecture}
    assert experts == {key: getattr(cfg.model.moe, key) for key in experts}


def _documented_counts() -> dict[str, int]:
    """`model=` name → the parameter count in docs/models.md's table."""
    rows = re.findall(
        r"^\| `model=(\w+)` .*\| ([\d,]+) \|$", (REPO / "docs/models.md").read_text(), re.M
    )
    return {name: int(count.replace(",", "")) for name, count in rows}


@pytest.mark.parametrize("name", NAMES)
def test_parameter_count_equals_transformers_and_the_docs(name):
    cfg = compose_config(f"model={name}").model
    theirs = json.loads((FIXTURES / "parameter_counts.json").read_text())[name]
    assert parameter_count(cfg) == theirs == _documented_counts()[name]


def test_tiny_moe_is_the_tiny_model_with_experts_in_place_of_its_mlps():
    """Every field of `tiny` but the family and the feed-forward: each of its 2 layers trades the
    dense MLP (3 · 128 · 512) for a router (128 · 8) and 8 experts (3 · 128 · 256 each)."""
    tiny, moe = compose_config("model=tiny").model, compose_config("model=tiny_moe").model
    same = {"name", "family", "mlp_dim", "moe"}
    for field in dataclasses.fields(tiny):
        if field.name not in same:
            assert getattr(moe, field.name) == getattr(tiny, field.name), field.name
    assert (moe.family, moe.moe.num_experts, moe.moe.top_k, moe.moe.expert_dim) == (
        "mixtral",
        8,
        2,
        256,
    )
    per_layer = 128 * 8 + 8 * 3 * 128 * 256 - 3 * 128 * 512
    assert parameter_count(moe) == parameter_count(tiny) + 2 * per_layer
    check_config(compose_config("model=tiny_moe", "model.mesh_shape=[[2,4],[ep,fsdp]]"))


def test_a_checkpoint_of_another_model_names_the_first_differing_field():
    cfg = compose_config("model=gemma3_1b")
    with pytest.raises(ConfigError) as err:
        check_matches(cfg.model, _published("gemma3_270m"), "gemma-3-270m/config.json")
    assert str(err.value) == (
        "model.d_model=1152 does not match hidden_size in gemma-3-270m/config.json "
        "(model.d_model=640); choose the model config of this checkpoint or set model.d_model=640"
    )
    scaled = dataclasses.replace(compose_config("model=gemma3_4b").model, rope_scaling="none")
    with pytest.raises(ConfigError, match=r"^model\.rope_scaling=none does not match "):
        check_matches(scaled, _published("gemma3_4b"), "config.json")


def test_gemma3_1b_takes_tp_beyond_its_one_key_value_head_but_not_beyond_its_query_heads():
    cfg = compose_config("model=gemma3_1b")
    check_against_mesh(cfg, parse_mesh_shape([[4, 2], ["fsdp", "tp"]], 8))  # K/V replicated
    with pytest.raises(ConfigError) as err:
        check_against_mesh(cfg, parse_mesh_shape([[1, 8], ["fsdp", "tp"]], 8))
    assert str(err.value) == (
        "tp=8 in model.mesh_shape does not divide model.num_heads=4; model gemma3_1b has 4 query "
        "heads and 1 key/value head(s); use tp in {1, 2, 4} (divisors of model.num_heads=4, "
        "model.mlp_dim=6912, model.vocab_size=262144)"
    )
