"""The schema: every field documented; every key the YAML configs set exists in it (they state
only what differs from its defaults); each allowed-value Literal matches the code that
implements its values; a composed config is typed."""

import ast
import dataclasses
import inspect
import itertools
from pathlib import Path

import pytest
import yaml
from helpers.config import CONFIG_DIR, compose_config

from meshtrain import config as config_module
from meshtrain.config import CheckpointConfig, Config, DataConfig, ModelConfig, TrainingConfig
from meshtrain.config.schema import (
    ClusterDetection,
    LayerKind,
    MixedPrecision,
    ReduceDtype,
    RematPolicy,
    choices,
)
from meshtrain.config.trackers import LoggingConfig, MlflowConfig, WandbConfig
from meshtrain.distributed.environment import CLUSTER_METHODS
from meshtrain.models.transformer import LAYER_KINDS, REMAT_POLICIES
from meshtrain.train.gradients import REDUCE_DTYPES
from meshtrain.train.step import COMPUTE_DTYPES

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
        LoggingConfig,
        WandbConfig,
        MlflowConfig,
    ],
)
def test_every_field_has_a_one_line_doc(cls):
    docs = _field_docs(cls)
    for field in dataclasses.fields(cls):
        assert docs.get(field.name, "").strip(), f"{cls.__name__}.{field.name} has no doc"
        assert "\n" not in docs[field.name].strip()


GROUP_YAMLS = sorted(p for p in CONFIG_DIR.glob("*/*.yaml") if p.parent.name in SCHEMAS)


@pytest.mark.parametrize("path", GROUP_YAMLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_key_of_a_group_yaml_exists_in_the_schema(path: Path):
    values = yaml.safe_load(path.read_text()) or {}
    unknown = set(values) - {f.name for f in dataclasses.fields(SCHEMAS[path.parent.name])}
    assert not unknown, f"{path.name} sets keys the schema does not have: {sorted(unknown)}"


@pytest.mark.parametrize("path", GROUP_YAMLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_group_yaml_restates_no_logical_axis_rules_of_the_schema(path: Path):
    values = yaml.safe_load(path.read_text()) or {}
    assert values.get("logical_axis_rules") != ModelConfig().logical_axis_rules


def test_model_yamls_state_only_the_architecture():
    training_keys = {"remat", "scan_layers", "init_from"}  # run choices, not architecture
    for path in sorted((CONFIG_DIR / "model").glob("*.yaml")):
        assert not training_keys & set(yaml.safe_load(path.read_text())), path.name


# data=stdlib skips the standard library's four deliberately Latin-1 and KOI8-R test files,
# where the schema's default for your own data is to stop at the first bad record.
STDLIB_DIFFERS = {"data": {"on_bad_record": "skip"}}


def test_the_default_groups_compose_to_the_schema_defaults():
    cfg = compose_config()
    for section, cls in SCHEMAS.items():
        expected = {**dataclasses.asdict(cls()), **STDLIB_DIFFERS.get(section, {})}
        assert dataclasses.asdict(getattr(cfg, section)) == expected, section
    for section in ("profile", "plan", "distributed", "logging"):
        cls = type(getattr(Config(), section))
        assert dataclasses.asdict(getattr(cfg, section)) == dataclasses.asdict(cls()), section


@pytest.mark.parametrize(
    ("literal", "implemented"),
    [
        (RematPolicy, tuple(REMAT_POLICIES)),
        (MixedPrecision, tuple(COMPUTE_DTYPES)),
        (ReduceDtype, tuple(REDUCE_DTYPES)),
        (LayerKind, LAYER_KINDS),
        (ClusterDetection, CLUSTER_METHODS),
    ],
)
def test_each_allowed_value_has_an_implementation(literal, implemented):
    assert choices(literal) == tuple(implemented)


def test_composed_config_is_typed():
    cfg = compose_config("training.steps=7", "model.mesh_shape=[[2,4],[fsdp,tp]]")
    assert isinstance(cfg, Config)
    assert cfg.training.steps == 7
    assert cfg.model.mesh_shape == [[2, 4], ["fsdp", "tp"]]
    assert cfg.experiment.name == "tiny"


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ((), "tiny"),
        (("model=qwen3_0_6b",), "qwen3_0_6b"),
        (("data=chat",), "tiny-chat"),
        (("data=chat", "model.lora.rank=8"), "tiny-chat-lora"),
        (("data=chat", "model.lora.rank=8", "model.lora.base_dtype=nf4"), "tiny-chat-qlora"),
        (("data=preference", "objective=dpo"), "tiny-dpo"),
        (("data=preference", "objective=dpo", "model.lora.rank=4"), "tiny-dpo-lora"),
        (("data=chat", "experiment.name=mine"), "mine"),
    ],
)
def test_a_run_is_named_after_what_it_does_to_the_model(overrides, name):
    assert compose_config(*overrides).experiment.name == name


def test_experiment_recipe_sets_mesh_and_batch():
    cfg = compose_config("experiment=tiny_fsdp")
    assert cfg.experiment.name == "tiny_fsdp"
    assert cfg.model.mesh_shape == [[8, 1], ["fsdp", "tp"]]
    assert cfg.training.micro_batch_size == 1
