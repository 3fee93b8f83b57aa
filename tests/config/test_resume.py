"""Which config keys a resume refuses, allows or ignores, and the lines it says so in."""

from dataclasses import asdict

import pytest

from meshtrain.config.data import MixtureSource
from meshtrain.config.resume import (
    ALLOWED,
    IGNORED,
    REFUSED,
    check_allow_changes,
    compare,
    flatten,
    key_class,
    refusal,
)
from meshtrain.config.schema import Config
from meshtrain.errors import ConfigError


def _config_with_mixture() -> Config:
    cfg = Config()
    cfg.data.mixture = [MixtureSource("a", ["x"], 0.9), MixtureSource("b", ["y"], 0.1)]
    return cfg


def test_every_schema_key_is_in_exactly_one_class():
    keys = flatten(asdict(_config_with_mixture()))
    assert "data.mixture[1].weight" in keys and "model.logical_axis_rules.embed" in keys
    for key in keys:
        covering = [
            name
            for name, prefixes in (("refused", REFUSED), ("allowed", ALLOWED), ("ignored", IGNORED))
            for prefix in prefixes
            if key == prefix or key.replace("[0]", "").replace("[1]", "").startswith(f"{prefix}.")
        ]
        assert covering == [key_class(key)], (key, covering)
    assert len(REFUSED) + len(ALLOWED) + len(IGNORED) == len(set(REFUSED + ALLOWED + IGNORED))


def test_flatten_names_mixture_entries_and_keeps_other_lists_whole():
    flat = flatten({"data": {"paths": ["a", "b"], "mixture": [{"name": "a", "weight": 1.0}]}})
    assert flat == {
        "data.paths": ["a", "b"],
        "data.mixture[0].name": "a",
        "data.mixture[0].weight": 1.0,
    }


def test_compare_sorts_changes_into_refused_on_purpose_and_allowed():
    saved = {
        "training.seed": 0,
        "training.learning_rate": 0.003,
        "data.mixture[0].weight": 0.9,
        "data.mixture[1].weight": 0.1,
        "plan.device": None,
    }
    now = {**saved, "training.seed": 1, "training.learning_rate": 0.001, "plan.device": "h100"}
    now["data.mixture[0].weight"], now["data.mixture[1].weight"] = 0.1, 0.9
    changes = compare(saved, now, allow=["data.mixture.weight"])
    assert [str(c) for c in changes] == [
        "training.seed 0 → 1",
        "training.learning_rate 0.003 → 0.001",
        "data.mixture[0].weight 0.9 → 0.1 (checkpoint.allow_changes)",
        "data.mixture[1].weight 0.1 → 0.9 (checkpoint.allow_changes)",
    ]
    assert [c.refused for c in changes] == [True, False, False, False]
    assert refusal(changes, "/run/checkpoints/10") == (
        "checkpoint /run/checkpoints/10 cannot be continued with this config: training.seed "
        "0 → 1; put the old value back, start a new run directory (hydra.run.dir=...), start "
        "fresh from these weights in a new run directory with "
        "checkpoint.load_params=/run/checkpoints/10, or accept the change on purpose with "
        "checkpoint.allow_changes=[training.seed]"
    )


def test_adapters_of_another_rank_are_not_offered_the_peft_restart():
    # Adapters exported from this checkpoint have its rank: model.lora.init_from=peft:DIR would
    # be refused for the same mismatch, so the line does not offer it.
    changes = compare({"model.lora.rank": 8}, {"model.lora.rank": 16}, allow=[])
    assert refusal(changes, "/run/checkpoints/2", adapters=True) == (
        "checkpoint /run/checkpoints/2 cannot be continued with this config: model.lora.rank "
        "8 → 16; put the old value back, start a new run directory (hydra.run.dir=...), or "
        "accept the change on purpose with checkpoint.allow_changes=[model.lora.rank]"
    )
    changes = compare({"model.lora.alpha": 8}, {"model.lora.alpha": 16}, allow=[])
    assert "model.lora.init_from=peft:DIR), or accept" in refusal(
        changes, "/run/checkpoints/2", adapters=True
    )


def test_a_mixture_entry_more_or_less_and_keys_older_checkpoints_lack():
    saved = {"data.mixture[0].name": "a", "data.mixture[0].weight": 1.0}
    now = {**saved, "data.mixture[1].name": "b", "data.mixture[1].weight": 1.0, "data.verify": 1}
    assert [str(c) for c in compare(saved, now, allow=[])] == [
        "data.mixture[1].name (none) → b",
        "data.mixture[1].weight (none) → 1.0",
    ]
    assert [str(c) for c in compare(now, saved, allow=["data.mixture[1]"])] == [
        "data.mixture[1].name b → (none) (checkpoint.allow_changes)",
        "data.mixture[1].weight 1.0 → (none) (checkpoint.allow_changes)",
    ]


@pytest.mark.parametrize("key", ["data.mixture", "data.mixture.weight", "model", "training.seed"])
def test_allow_changes_takes_compared_keys_and_their_parts(key):
    check_allow_changes([key])


def test_allow_changes_refuses_a_key_resume_does_not_compare():
    with pytest.raises(ConfigError) as err:
        check_allow_changes(["data.tokeniser"])
    assert str(err.value) == (
        "checkpoint.allow_changes: 'data.tokeniser' is not a key that resume compares (did you "
        "mean 'data.tokenizer'?); list keys such as data.mixture or training.seed "
        "(docs/checkpointing.md#what-resume-compares)"
    )
    with pytest.raises(ConfigError, match=r"'plan\.device' is not a key that resume compares"):
        check_allow_changes(["plan.device"])
