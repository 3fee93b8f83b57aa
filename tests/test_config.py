"""The YAML configs and the dataclass schemas agree; every field is documented; validation."""

import ast
import dataclasses
import inspect
import itertools
from pathlib import Path

import pytest
import yaml
from conftest import CONFIG_DIR, compose_config

from meshtrain import config as config_module
from meshtrain.config import CheckpointConfig, Config, DataConfig, ModelConfig, TrainingConfig
from meshtrain.errors import ConfigError
from meshtrain.parallel.mesh import parse_mesh_shape
from meshtrain.config.validate import check_against_mesh, check_config

SCHEMAS = {
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
}


def _field_docs(cls) -> dict[str, str]:
    """Field name → the string literal right under it in the class body."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, following in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            docs[node.target.id] = following.value.value
    return docs


@pytest.mark.parametrize(
    "cls",
    [
        ModelConfig,
        DataConfig,
        TrainingConfig,
        CheckpointConfig,
        config_module.ExperimentConfig,
        config_module.DistributedConfig,
        config_module.ProfileConfig,
        config_module.PlanConfig,
    ],
)
def test_every_field_has_a_one_line_doc(cls):
    docs = _field_docs(cls)
    for field in dataclasses.fields(cls):
        assert docs.get(field.name, "").strip(), f"{cls.__name__}.{field.name} has no doc"
        assert "\n" not in docs[field.name].strip()


@pytest.mark.parametrize(
    "path", sorted(p for p in CONFIG_DIR.glob("*/*.yaml") if p.parent.name in SCHEMAS), ids=str
)
def test_group_yaml_sets_exactly_the_schema_fields(path: Path):
    values = yaml.safe_load(path.read_text())
    assert set(values) == {f.name for f in dataclasses.fields(SCHEMAS[path.parent.name])}


@pytest.mark.parametrize(
    "group", ["model/tiny", "data/stdlib", "training/default", "checkpoint/default"]
)
def test_default_yaml_equals_dataclass_defaults(group):
    section, name = group.split("/")
    values = yaml.safe_load((CONFIG_DIR / section / f"{name}.yaml").read_text())
    defaults = dataclasses.asdict(SCHEMAS[section]())
    assert values == defaults


@pytest.mark.parametrize(
    ("section", "cls"),
    [("profile", config_module.ProfileConfig), ("plan", config_module.PlanConfig)],
)
def test_config_yaml_sections_equal_dataclass_defaults(section, cls):
    values = yaml.safe_load((CONFIG_DIR / "config.yaml").read_text())[section]
    assert values == dataclasses.asdict(cls())


def test_composed_config_is_typed():
    cfg = compose_config("training.steps=7", "model.mesh_shape=[[2,4],[fsdp,tp]]")
    assert isinstance(cfg, Config)
    assert cfg.training.steps == 7
    assert cfg.model.mesh_shape == [[2, 4], ["fsdp", "tp"]]
    assert cfg.experiment.name == "tiny"


def test_experiment_recipe_sets_mesh_and_batch():
    cfg = compose_config("experiment=tiny_fsdp")
    assert cfg.experiment.name == "tiny_fsdp"
    assert cfg.model.mesh_shape == [[8, 1], ["fsdp", "tp"]]
    assert cfg.training.micro_batch_size == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.num_kv_heads=3"], "model.num_kv_heads=3 does not divide model.num_heads=16"),
        (["model.head_dim=15"], "model.head_dim=15 must be even"),
        (
            ["training.mixed_precision=fp16"],
            "training.mixed_precision='fp16' is not supported; use one of: fp32, bf16",
        ),
        (["training.micro_batch_size=0"], "training.micro_batch_size=0 must be positive"),
        (["data.validation_fraction=1.0"], "data.validation_fraction=1.0 must be in [0, 1)"),
        (
            ["training.nonfinite=ignore"],
            "training.nonfinite='ignore' is not supported; use one of: stop, skip",
        ),
        (
            ["model.mlp_activation=relu"],
            "model.mlp_activation='relu' is not supported; use one of: silu, gelu",
        ),
    ],
)
def test_check_config_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_config(compose_config(*overrides))
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "mesh", "message"),
    [
        (
            ["model.num_heads=18", "model.num_kv_heads=6"],
            [[2, 4], ["fsdp", "tp"]],
            "tp=4 in model.mesh_shape does not divide model.num_heads=18; use tp in {1, 2}",
        ),
        (
            ["model.num_heads=12", "model.num_kv_heads=6"],
            [[2, 4], ["fsdp", "tp"]],
            "tp=4 in model.mesh_shape does not divide model.num_kv_heads=6; use tp in {1, 2}",
        ),
        (
            ["model.mlp_dim=500"],
            [[1, 8], ["fsdp", "tp"]],
            "tp=8 in model.mesh_shape does not divide model.mlp_dim=500; use tp in {1, 2, 4}",
        ),
        (
            ["model.vocab_size=260"],
            [[1, 8], ["fsdp", "tp"]],
            "tp=8 in model.mesh_shape does not divide model.vocab_size=260; use tp in {1, 2, 4}",
        ),
    ],
)
def test_tp_must_divide_the_sharded_dimensions(overrides, mesh, message):
    cfg = compose_config(*overrides)
    with pytest.raises(ConfigError) as err:
        check_against_mesh(cfg, parse_mesh_shape(mesh, 8))
    assert message in str(err.value)
