"""Start-up validation: one line naming the key, the value and the fix, before anything compiles."""

import pytest
from helpers.config import compose_config

from meshtrain.config.validate import check_against_mesh, check_config
from meshtrain.errors import ConfigError
from meshtrain.parallel.mesh import parse_mesh_shape


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
            ["data.source=text_files"],
            "data.source=text_files is now data.source=text (data=text, or data=stdlib for the "
            "standard library); data.path and data.glob work as before",
        ),
        (
            ["data.on_bad_record=ignore"],
            "data.on_bad_record='ignore' is not supported; use one of: error, skip",
        ),
        (["data.workers=-1"], "data.workers=-1 must be >= 0 (0: no read-ahead)"),
        (
            ["data.source=prepared"],
            "data.source=prepared needs data.path=DIR, a directory made by "
            "python -m meshtrain.data.prepare --out DIR ...",
        ),
        (
            ["data.mixture=[{name:code,paths:[a],weight:0.7},{name:prose,paths:[b],weight:0}]"],
            "data.mixture[1].weight=0.0 must be > 0; drop source 'prose' from data.mixture to "
            "leave it out",
        ),
        (
            ["data.mixture=[{name:a,paths:[x]},{name:a,paths:[y]}]"],
            "data.mixture[1].name='a' must be a unique, non-empty name",
        ),
        (
            ["data.paths=[a]", "data.mixture=[{name:a,paths:[x]}]"],
            "data.paths and data.mixture are both set; list the paths in the mixture's sources",
        ),
        (
            ["training.nonfinite=ignore"],
            "training.nonfinite='ignore' is not supported; use one of: stop, skip",
        ),
        (
            ["model.mlp_activation=relu"],
            "model.mlp_activation='relu' is not supported; use one of: silu, gelu",
        ),
        (
            ["training.gradient_accumulation_steps=12", "training.sync_gradients_every=5"],
            "training.sync_gradients_every=5 does not divide "
            "training.gradient_accumulation_steps=12; use one of 1, 2, 3, 4, 6, 12",
        ),
        (
            ["training.sync_gradients_every=0"],
            "training.sync_gradients_every=0 must be positive",
        ),
        (
            ["training.reduce_dtype=fp16"],
            "training.reduce_dtype='fp16' is not supported; use one of: fp32, bf16",
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
            "tp=4 in model.mesh_shape does not divide model.num_heads=18; model tiny has 18 query "
            "heads and 6 key/value head(s); use tp in {1, 2}",
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


def test_tp_need_not_divide_the_key_value_heads():
    """They are replicated over tp instead (models.abstract.fit_kv_heads)."""
    cfg = compose_config("model.num_heads=12", "model.num_kv_heads=6")
    check_against_mesh(cfg, parse_mesh_shape([[2, 4], ["fsdp", "tp"]], 8))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.attention_pattern=[local,everywhere]"],
            "model.attention_pattern=[local,everywhere] must be a non-empty list of global and "
            "local, e.g. [local,local,local,local,local,global]",
        ),
        (
            ["model.attention_pattern=[local,global]"],
            "model.sliding_window=null must be a positive number of tokens because "
            "model.attention_pattern=[local,global] has local layers",
        ),
        (
            ["model.rope_scaling=yarn"],
            "model.rope_scaling='yarn' is not supported; use one of: none, linear, llama3",
        ),
        (
            ["model.rope_scaling=llama3", "model.rope_high_freq_factor=0.5"],
            "model.rope_high_freq_factor=0.5 must be greater than model.rope_low_freq_factor=1.0",
        ),
        (
            ["model.remat=some"],
            "model.remat='some' is not supported; use one of: none, full, dots_saveable, minimal",
        ),
        (
            ["model.family=mistral"],
            "model.family='mistral' is not supported; use one of: llama, qwen3, gemma3",
        ),
        (
            ["data.seq_len=4096"],
            "data.seq_len=4096 is longer than model.max_seq_len=2048 of model tiny; use "
            "data.seq_len <= 2048",
        ),
    ],
)
def test_family_field_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_config(compose_config(*overrides))
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["checkpoint.every_steps=-1"], "checkpoint.every_steps=-1 must be >= 0"),
        (["checkpoint.keep=0"], "checkpoint.keep=0 must be >= 1"),
        (
            ["checkpoint.resume=/some/run", "checkpoint.load_params=/other/run"],
            "checkpoint.resume=/some/run and checkpoint.load_params=/other/run are both set",
        ),
    ],
)
def test_checkpoint_values_are_checked_with_the_rest_of_the_config(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_config(compose_config(*overrides))
    assert message in str(err.value)
