"""train.starting_weights: a start reads its weights once, whoever needs them: the policy and
a reference copy (objective.reference=initial), the precomputed reference's scoring and the
policy, the LoRA base and the scoring with the adapters off; the runs' numbers are those of the
reads they replace (tests/train/test_reference_scores.py, test_preference.py)."""

from __future__ import annotations

import pytest
from helpers.preference_runs import dpo_overrides, pairs_file
from helpers.runs import train_tiny

from meshtrain.train import starting_weights

PRECOMPUTED = "objective.reference=precomputed"
LORA = "model.lora.rank=4"


@pytest.mark.parametrize(
    "overrides",
    [(), (PRECOMPUTED,), (LORA, PRECOMPUTED)],
    ids=["reference-copy", "precomputed", "lora-precomputed"],
)
def test_a_start_reads_its_weights_once(tmp_path, monkeypatch, overrides):
    reads = {"params": 0, "base": 0}

    def counted(name, read):
        def wrapper(*args, **kwargs):
            reads[name] += 1
            return read(*args, **kwargs)

        return wrapper

    load_params = starting_weights.load_initial_params
    load_base = starting_weights.load_frozen_base
    monkeypatch.setattr(starting_weights, "load_initial_params", counted("params", load_params))
    monkeypatch.setattr(starting_weights, "load_frozen_base", counted("base", load_base))
    pairs = pairs_file(tmp_path)
    caches = f"data.cache_dir={tmp_path / 'cache'}"  # the scores not yet cached: scored here
    run = train_tiny(
        tmp_path / "run", *dpo_overrides(pairs), caches, "training.steps=1", *overrides, devices=1
    )
    assert len(run.history) == 1
    expected = {"params": 0, "base": 1} if LORA in overrides else {"params": 1, "base": 0}
    assert reads == expected
