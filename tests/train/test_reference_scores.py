"""objective.reference=precomputed (meshtrain.train.reference_scores): the reference scores the
pairs once before training, each row carries its targets' scores, and the step, which runs the
policy alone, gives the numbers of the reference run in the step; the scores are cached by what
they depend on and read again, on any mesh."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.config import compose_config
from helpers.preference_runs import dpo_overrides, pairs_file
from helpers.runs import train_tiny

from meshtrain.train.dry_run import dry_run
from meshtrain.train.objectives.token_scores import split_reference_scores, with_reference_scores
from meshtrain.train.reference_scores import ReferenceScored

KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/rejected")
VALIDATION = ("data.validation_fraction=0.25", "training.eval_every=3")
PRECOMPUTED = "objective.reference=precomputed"


class _Rows:
    vocab_size, pad_id, seq_len, split = 512, 0, 8, "train"

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.rows[index]


def test_a_row_carries_its_scores_bit_for_bit():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 2**31 - 1, (3, 9), dtype=np.int32)  # ids with their marks' high bits
    scores = rng.normal(-5, 3, (3, 8)).astype(np.float32)
    scores[0, 0] = -np.inf  # a target the reference gives no probability
    packed = with_reference_scores(rows, scores)
    assert packed.shape == (3, 17) and packed.dtype == np.int32
    tokens, read = split_reference_scores(jnp.asarray(packed))
    np.testing.assert_array_equal(np.asarray(tokens), rows)
    np.testing.assert_array_equal(np.asarray(read), scores)
    scored = ReferenceScored(_Rows(rows), scores)
    assert (len(scored), scored.seq_len, scored.split) == (3, 8, "train")
    np.testing.assert_array_equal(scored[2], packed[2])
    with pytest.raises(ValueError, match=r"scores \(3, 7\) for 3 rows of 8"):
        ReferenceScored(_Rows(rows), scores[:, :7])


def _log(run_dir) -> str:
    return (run_dir / "train.log").read_text()


def _assert_same_numbers(a, b, rtol, atol=1e-7):
    assert len(a.history) == len(b.history) == 3
    for x, y in zip(a.history, b.history, strict=True):
        for key in (*KEYS, *(("val_loss", "val_rewards/margins") if "val_loss" in x else ())):
            np.testing.assert_allclose(y[key], x[key], rtol=rtol, atol=atol, err_msg=key)


@pytest.mark.slow  # four tiny DPO runs, 25 s on 2 cores
def test_precomputed_scores_give_the_numbers_of_the_reference_in_the_step(tmp_path):
    pairs = pairs_file(tmp_path)
    run = (*dpo_overrides(pairs), *VALIDATION)
    in_step = train_tiny(tmp_path / "in_step", *run, devices=1)
    first = train_tiny(tmp_path / "first", *run, PRECOMPUTED, devices=1)
    _assert_same_numbers(in_step, first, rtol=1e-6)
    assert "reference: scored the 20 rows of the train split" in _log(tmp_path / "first")
    assert "reference: scored the 4 rows of the validation split" in _log(tmp_path / "first")
    # The step holds no copy of the weights for the reference.
    plans = [json.loads((tmp_path / d / "plan.json").read_text()) for d in ("in_step", "first")]
    assert plans[0]["reference_bytes"] == plans[0]["params_bytes"] > 0
    assert plans[1]["reference_bytes"] == 0
    assert plans[1]["params_bytes"] == plans[0]["params_bytes"]
    # Read again from the cache, on any mesh and split of the batch.
    split = train_tiny(
        tmp_path / "split",
        *run,
        PRECOMPUTED,
        "model.mesh_shape=[[4,2],[fsdp,tp]]",
        "training.gradient_accumulation_steps=2",
        devices=8,
    )
    # The policy on the mesh against scores of one device: rewards of 0 differ by fp32 rounding.
    _assert_same_numbers(first, split, rtol=1e-5, atol=1e-6)
    log = _log(tmp_path / "split")
    assert "reference: the train split's scores from " in log and "scored the" not in log
    # Other pairs are other rows: scored anew, never read from another set's file.
    (tmp_path / "other").mkdir()
    other = pairs_file(tmp_path / "other", count=32)
    train_tiny(tmp_path / "fresh", *dpo_overrides(other), *VALIDATION, PRECOMPUTED, devices=1)
    assert "reference: scored the 25 rows of the train split" in _log(tmp_path / "fresh")


@pytest.mark.slow  # two tiny LoRA DPO runs
def test_with_lora_the_scores_are_the_base_with_the_adapters_off(tmp_path):
    pairs = pairs_file(tmp_path)
    lora = ("model.lora.rank=4", "training.learning_rate=1e-2")
    in_step = train_tiny(tmp_path / "in_step", *dpo_overrides(pairs), *lora, devices=1)
    precomputed = train_tiny(
        tmp_path / "precomputed", *dpo_overrides(pairs), *lora, PRECOMPUTED, devices=1
    )
    _assert_same_numbers(in_step, precomputed, rtol=1e-6)
    assert precomputed.history[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert precomputed.history[-1]["loss"] != precomputed.history[0]["loss"]  # it trains


@pytest.mark.slow  # three tiny DPO runs
def test_a_resumed_run_reads_its_scores_or_scores_again_with_the_same_numbers(tmp_path):
    pairs = pairs_file(tmp_path)
    run = (*dpo_overrides(pairs), PRECOMPUTED, "training.steps=4", "training.lr_schedule=constant")
    whole = train_tiny(tmp_path / "whole", *run, devices=1)
    saved = (*run, "checkpoint.every_steps=2")
    train_tiny(tmp_path / "resumed", *saved, "training.steps=2", devices=1)
    # The scores' file the first start wrote goes: the resumed start scores again, from the
    # starting weights (the seed's draw here), not from the weights it resumes.
    written = re.findall(r"train split in [\d.]+ s → (\S+)", _log(tmp_path / "whole"))
    assert len(written) == 1
    Path(written[0]).unlink()
    resumed = train_tiny(tmp_path / "resumed", *saved, devices=1)
    log = _log(tmp_path / "resumed")  # its first start read the scores "whole" wrote
    assert "resuming from" in log
    assert log.count("reference: the train split's scores from ") == 1
    assert log.count("reference: scored the 24 rows of the train split") == 1
    by_step = {h["step"]: h for h in whole.history}
    assert [h["step"] for h in resumed.history] == [3, 4]
    for h in resumed.history:
        for key in KEYS:
            assert h[key] == by_step[h["step"]][key], key


@pytest.mark.slow  # two dry runs on [[4,2]]
def test_a_dry_run_compiles_the_references_scoring_program(tmp_path, capsys):
    """With objective.reference=precomputed, training.dry_run=true also compiles the program that
    scores the pairs before training (compile.json's `reference`): a forward pass over a
    micro-batch's rows, with the LoRA base too; without it there is no such entry."""
    run = (*dpo_overrides(pairs_file(tmp_path)), "model.mesh_shape=[[4,2],[fsdp,tp]]")
    for name, extra in (
        ("in_step", ()),
        ("precomputed", (PRECOMPUTED,)),
        ("lora", (PRECOMPUTED, "model.lora.rank=4")),
    ):
        cfg = compose_config(*run, *extra, "training.dry_run=true")
        dry_run(cfg, tmp_path / name, devices=jax.devices())
    reports = {
        name: json.loads((tmp_path / name / "compile.json").read_text())
        for name in ("in_step", "precomputed", "lora")
    }
    assert reports["in_step"]["reference"] is None
    for name in ("precomputed", "lora"):
        scoring = reports[name]["reference"]
        assert scoring["fusions"] > 0 and scoring["seconds"] > 0 and scoring["matmul_flops"] > 0
    # The scoring pass is a forward over the rows: less than the step's (forward and backward).
    assert (
        reports["precomputed"]["reference"]["matmul_flops"]
        < reports["precomputed"]["step"]["matmul_flops"]
    )
    assert "compiled the reference's scoring program in " in capsys.readouterr().out
