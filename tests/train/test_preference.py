"""objective=dpo (meshtrain.train.objectives.preference): the pair losses are the published
formulas, the loss and gradients of packed pairs equal the unfused definition (each sequence
alone, log_softmax over its whole logits), the same on any mesh and split of the batch, and bad
settings are one line before anything compiles. trl's DPOTrainer itself: tests/hf/
test_preference_live.py (slow, the parity extra)."""

from __future__ import annotations

import json
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.commands import train_command
from helpers.config import compose_config
from helpers.objectives import FLAGGED, tiny_policy
from helpers.preference_runs import TOKENIZER, dpo_overrides, pairs_file
from helpers.process import run_training, subprocess_env
from helpers.runs import train_tiny

from meshtrain.checkpoint import committed_steps, read_meta
from meshtrain.checkpoint.writes import TEST_KILL_ENV
from meshtrain.config.objective import ObjectiveConfig
from meshtrain.config.schema import DEFAULT_LOGICAL_AXIS_RULES
from meshtrain.config.validate import check_config
from meshtrain.data.chat.marks import DOCUMENT_START, NOT_TRAINED
from meshtrain.data.chat.pairs import EncodedPair
from meshtrain.errors import ConfigError
from meshtrain.train.loss import target_log_probs
from meshtrain.train.objectives import Preference, StepInputs
from meshtrain.train.objectives.preference import pair_loss
from meshtrain.train.setup import prepare


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


@pytest.mark.parametrize(
    ("loss_type", "smoothing"),
    [
        ("sigmoid", 0.0),
        ("sigmoid", 0.2),
        ("robust", 0.2),
        ("hinge", 0.0),
        ("ipo", 0.0),
        ("simpo", 0.1),
    ],
)
def test_pair_losses_are_the_published_formulas(loss_type, smoothing):
    rng = np.random.default_rng(0)
    c, r, rc, rr = (rng.normal(-40, 10, 6) for _ in range(4))
    nc, nr = rng.integers(1, 30, 6).astype(float), rng.integers(1, 30, 6).astype(float)
    beta, gamma = 0.3, 0.7
    cfg = ObjectiveConfig(
        name="dpo", loss_type=loss_type, beta=beta, label_smoothing=smoothing, gamma=gamma
    )
    ours = pair_loss(*(jnp.asarray(a, jnp.float32) for a in (c, r, rc, rr, nc, nr)), cfg)
    delta = (c - rc) - (r - rr)
    expected = {  # DPO (Rafailov et al. 2023), cDPO, rDPO (Chowdhury et al. 2024), SLiC, IPO, SimPO
        "sigmoid": -(1 - smoothing) * _log_sigmoid(beta * delta)
        - smoothing * _log_sigmoid(-beta * delta),
        "robust": (
            -(1 - smoothing) * _log_sigmoid(beta * delta) + smoothing * _log_sigmoid(-beta * delta)
        )
        / (1 - 2 * smoothing),
        "hinge": np.maximum(0.0, 1 - beta * delta),
        "ipo": ((c - rc) / nc - (r - rr) / nr - 1 / (2 * beta)) ** 2,
        "simpo": -(1 - smoothing) * _log_sigmoid(beta * (c / nc - r / nr) - gamma)
        - smoothing * _log_sigmoid(-(beta * (c / nc - r / nr) - gamma)),
    }[loss_type]
    np.testing.assert_allclose(ours, expected, rtol=2e-6)


def test_target_log_probs_and_entropies_are_log_softmaxs_in_any_chunks():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 29, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(40, 16)) / 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (3, 29)), jnp.int32)
    log_probs = jax.nn.log_softmax(jnp.einsum("BTD,VD->BTV", x, w), axis=-1)
    expected = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    entropies = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    assert 1.0 < float(entropies.min()) < float(entropies.max()) < np.log(40)
    for chunk_rows in (3 * 29, 3 * 8, 3):
        ours = target_log_probs(
            x, w, "VD", targets, rules=DEFAULT_LOGICAL_AXIS_RULES, chunk_rows=chunk_rows
        )
        np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6)
        ours, entropy = target_log_probs(
            x,
            w,
            "VD",
            targets,
            rules=DEFAULT_LOGICAL_AXIS_RULES,
            chunk_rows=chunk_rows,
            entropy=True,
        )
        np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(entropy, entropies, rtol=1e-5)


# Two rows of packed pairs: (prompt length, chosen answer, rejected answer) token counts.
ROWS = [[(3, 4, 2), (2, 1, 5)], [(4, 3, 3)]]
LENGTH = 33  # seq_len + 1


def _packed_rows(rng, shared_prompt: bool):
    """Flagged rows [2, LENGTH] of ROWS' pairs, each unit as a prepared corpus stores it
    (EncodedPair.flagged, in data.shared_prompt's layout) and packing marks it (DOCUMENT_START on
    its first token), and each pair's two sequences unpacked."""
    rows, sequences = [], []
    for row in ROWS:
        units = []
        for prompt, chosen, rejected in row:
            shared = rng.integers(1, 300, prompt)
            pair = EncodedPair(
                *(np.concatenate([shared, rng.integers(1, 300, n)]) for n in (chosen, rejected)),
                prompt_length=prompt,
            )
            unit = pair.flagged(shared_prompt=shared_prompt)
            unit[0] |= DOCUMENT_START
            units.append(unit)
            sequences.append([(pair.chosen, prompt), (pair.rejected, prompt)])
        row = np.concatenate(units)
        rows.append(np.concatenate([row, np.full(LENGTH - len(row), NOT_TRAINED, np.uint32)]))
    return jnp.asarray(np.stack(rows).astype(np.int32)), sequences


@pytest.mark.parametrize(
    ("loss_type", "shared_prompt"),
    [
        ("sigmoid", True),
        pytest.param("ipo", True, marks=pytest.mark.slow),
        pytest.param("sigmoid", False, marks=pytest.mark.slow),
    ],
)
def test_packed_pairs_give_the_loss_and_gradients_of_each_sequence_alone(loss_type, shared_prompt):
    policy = tiny_policy()
    params, reference = policy.params, policy.reference
    rows, sequences = _packed_rows(np.random.default_rng(0), shared_prompt)
    objective_cfg = ObjectiveConfig(name="dpo", loss_type=loss_type, beta=0.2)
    objective = Preference(StepInputs(FLAGGED, jnp.float32), objective_cfg)
    sums, grads = jax.jit(objective.loss_and_grads(policy.model))(params, rows, reference)

    def one(weights, ids, prompt):  # the answer's log-probability, the sequence alone
        picked = policy.log_probs_alone(weights, ids, LENGTH)
        answer = (np.arange(LENGTH - 1) >= prompt - 1) & (np.arange(LENGTH - 1) < len(ids) - 1)
        return jnp.sum(jnp.where(answer, picked, 0.0)), len(ids) - prompt

    def definition(weights):
        losses = []
        for (c_ids, prompt), (r_ids, _) in sequences:
            (c, nc), (r, nr) = one(weights, c_ids, prompt), one(weights, r_ids, prompt)
            (rc, _), (rr, _) = one(reference, c_ids, prompt), one(reference, r_ids, prompt)
            losses.append(pair_loss(c, r, rc, rr, float(nc), float(nr), objective_cfg))
        return jnp.sum(jnp.stack(losses))

    expected, expected_grads = jax.value_and_grad(definition)(params)
    assert float(sums["count"]) == 3.0
    np.testing.assert_allclose(sums["loss"], expected, rtol=1e-5)
    for ours, theirs in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=2e-6)


def _dpo(tmp_path, pairs, *overrides, devices):
    return train_tiny(tmp_path, *dpo_overrides(pairs), *overrides, devices=devices)


@pytest.mark.slow
def test_the_same_pairs_give_the_same_losses_on_any_mesh_and_split(tmp_path):
    pairs = pairs_file(tmp_path)
    one = _dpo(tmp_path / "one", pairs, devices=1)
    split = _dpo(
        tmp_path / "split",
        pairs,
        "model.mesh_shape=[[4,2],[fsdp,tp]]",
        "training.gradient_accumulation_steps=2",
        devices=8,
    )
    keys = (
        "loss",
        "grad_norm",
        "rewards/chosen",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    )
    for a, b in zip(one.history, split.history, strict=True):
        for key in keys:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)
    assert one.history[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # policy = reference
    assert one.history[-1]["rewards/margins"] > 0  # it learns to prefer the right sums
    # The reference copy is one more set of parameters, sharded like them, not a LoRA base.
    for run_dir in (tmp_path / "one", tmp_path / "split"):
        plan = json.loads((run_dir / "plan.json").read_text())
        assert plan["reference_bytes"] == plan["params_bytes"] > 0
        assert (plan["frozen_bytes"], plan["lora"]) == (0, None)


@pytest.mark.slow  # three more meshes of 8 devices, about 40 s
@pytest.mark.parametrize(
    ("mesh", "accumulation", "global_batch"),
    [
        ("[[8,1],[fsdp,tp]]", 1, 8),
        ("[[2,2,2],[dp,fsdp,tp]]", 1, 8),
        ("[[2,2,2],[dp,fsdp,tp]]", 4, 16),
    ],
)
def test_more_meshes_and_splits(mesh, accumulation, global_batch, tmp_path):
    # 4 batch shards (dp × fsdp) × 4 accumulation steps take 16 pairs a step, one per row.
    pairs = pairs_file(tmp_path, count=48)
    batch = f"training.global_batch_size={global_batch}"
    one = _dpo(tmp_path / "one", pairs, batch, devices=1)
    other = _dpo(
        tmp_path / "other",
        pairs,
        batch,
        f"model.mesh_shape={mesh}",
        f"training.gradient_accumulation_steps={accumulation}",
        devices=8,
    )
    for a, b in zip(one.history, other.history, strict=True):
        for key in ("loss", "grad_norm", "rewards/accuracies", "logps/rejected"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("objective=dpo",),
            "objective=dpo trains on pairs of answers: set data=preference (data.source='text' holds no pairs)",
        ),
        (
            ("objective=dpo", "data=preference", "objective.beta=0"),
            "objective.beta=0.0 must be > 0",
        ),
        (
            ("objective=dpo", "data=preference", "objective.loss_type=simpo"),
            "objective.loss_type=simpo is reference-free: set objective.reference=none",
        ),
        (
            ("objective=dpo", "data=preference", "objective.reference=none"),
            "objective.loss_type=sigmoid measures the policy against a reference: set "
            "objective.reference=initial (or objective.loss_type=simpo, which needs none)",
        ),
        (
            (
                "objective=dpo",
                "data=preference",
                "objective.loss_type=ipo",
                "objective.label_smoothing=0.1",
            ),
            "objective.label_smoothing=0.1 applies to sigmoid, robust and simpo, not ipo; set it to 0",
        ),
        (
            ("objective=dpo", "data=preference", "objective.label_smoothing=0.5"),
            "objective.label_smoothing=0.5 must be in [0, 0.5)",
        ),
        (
            ("objective=dpo", "data=preference", "objective.loss_type=kto"),
            "objective.loss_type='kto' is not supported; use one of: sigmoid, ipo, hinge, robust, simpo",
        ),
        (
            ("objective=dpo", "data=preference", "data.document_masking=false"),
            "objective=dpo reads each pair's answers as documents: set data.document_masking=true",
        ),
        (
            ("objective=dpo", "data=preference", "objective.reference=frozen"),
            "objective.reference='frozen' is not supported; use one of: initial, precomputed, none",
        ),
        (
            ("objective.name=ppo",),
            "objective.name='ppo' is not supported; use one of: lm, dpo, grpo",
        ),
        (
            (
                "objective=dpo",
                "data=preference",
                "model.attention_pattern=[local,global]",
                "model.sliding_window=64",
                "data.seq_len=128",
            ),
            "data.shared_prompt=true packs a pair's rejected answer after its chosen one, so its "
            "prompt can lie beyond model.sliding_window=64 in sequences of data.seq_len=128: set "
            "data.shared_prompt=false (the prompt once per answer), or data.seq_len<=64",
        ),
    ],
)
def test_bad_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        check_config(
            compose_config(*overrides, "data.paths=[x.jsonl]", f"data.tokenizer={TOKENIZER}")
        )
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        (
            "[[2,4],[pp,fsdp]]",
            "objective=dpo runs under no pipeline schedule, not model.mesh_shape's pp=2 with "
            "training.pipeline.schedule=gpipe; use a mesh without pp (e.g. fsdp or dp instead)",
        ),
        (
            "[[2,4],[cp,fsdp]]",
            "objective=dpo does not split sequences over cp (cp=2 in model.mesh_shape); use a "
            "mesh without cp",
        ),
    ],
)
def test_meshes_the_objective_cannot_run_on_are_one_line(mesh, message, tmp_path):
    cfg = compose_config(
        "objective=dpo",
        "data=preference",
        f"data.paths=[{pairs_file(tmp_path)}]",
        f"data.tokenizer={TOKENIZER}",
        "model.vocab_size=512",
        f"model.mesh_shape={mesh}",
        "model.scan_layers=true",
        "training.global_batch_size=8",
    )
    with pytest.raises(ConfigError) as error:
        prepare(cfg, jax.devices(), with_data=False)
    assert str(error.value) == message


@pytest.mark.slow
def test_a_resumed_run_reads_its_reference_again_and_compares_it(tmp_path, capsys):
    """The reference is never checkpointed: a resume reads it again from the starting weights
    (here the first run's step-2 checkpoint, checkpoint.load_params) and compares their identity.
    That the resumed steps are those of the run never stopped, bit for bit: the SIGKILL test
    below (slow)."""
    pairs = pairs_file(tmp_path)
    start = _dpo(
        tmp_path / "start", pairs, "training.steps=2", "checkpoint.every_steps=2", devices=1
    )
    weights = tmp_path / "start" / "checkpoints" / "2"
    common = (
        f"checkpoint.load_params={weights}",
        "training.lr_schedule=constant",
        "checkpoint.every_steps=2",
    )
    first = _dpo(tmp_path / "halves", pairs, *common, "training.steps=2", devices=1)
    assert first.history[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # policy = reference
    assert start.history[-1]["loss"] != first.history[0]["loss"]

    capsys.readouterr()
    resumed = _dpo(
        tmp_path / "halves", pairs, *common, "training.steps=3", "objective.beta=0.2", devices=1
    )
    assert [h["step"] for h in resumed.history] == [3]
    assert (
        "resuming with changed settings: training.steps 2 → 3, objective.beta 0.1 → 0.2\n"
        in capsys.readouterr().out
    )

    other_weights = tmp_path / "halves" / "checkpoints" / "2"  # not the starting weights
    moved = (*common[1:], f"checkpoint.load_params={other_weights}")
    with pytest.raises(ConfigError) as err:
        _dpo(tmp_path / "halves", pairs, *moved, "training.steps=4", devices=1)
    assert str(err.value).startswith(
        f"checkpoint {tmp_path / 'halves' / 'checkpoints' / '3'} cannot be continued with this "
        f"config: objective.reference_weights checkpoint.load_params={weights} → "
        f"checkpoint.load_params={other_weights}; put the old value back"
    )
    assert str(err.value).endswith("checkpoint.allow_changes=[objective.reference_weights]")


@pytest.mark.slow  # a child process killed with SIGKILL, then resumed
def test_a_sigkilled_dpo_run_resumes_bit_identically(tmp_path):
    """Killed right after its step-3 checkpoint committed, a DPO run resumes there: steps 4-6
    log the losses, rewards and log-probabilities of the run that was never stopped, bit for
    bit, and its step-6 checkpoint holds the same values (the reference, never checkpointed, is
    read again from the starting weights)."""
    pairs = pairs_file(tmp_path)
    run = (*dpo_overrides(pairs), "training.lr_schedule=constant", "checkpoint.every_steps=3")
    start = tmp_path / "start"
    result = train_command(*run, "training.steps=2", f"hydra.run.dir={start}", devices=1)
    assert result.returncode == 0, result.stderr[-3000:]
    run = (*run, f"checkpoint.load_params={start / 'checkpoints' / '2'}", "training.steps=6")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    result = train_command(*run, f"hydra.run.dir={straight}", devices=1)
    assert result.returncode == 0, result.stderr[-3000:]
    env = subprocess_env(1)
    env[TEST_KILL_ENV] = "3"
    result = run_training(*run, f"hydra.run.dir={crashed}", devices=1, env=env, timeout=600)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert committed_steps(crashed / "checkpoints") == [3]
    result = train_command(*run, f"hydra.run.dir={crashed}", devices=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {crashed}/checkpoints/3 at step 3" in result.stdout

    def logged(run_dir):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        keys = ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")
        return {r["step"]: [r[k] for k in keys] for r in records if r["step"] > 3}

    assert logged(crashed) == logged(straight) and sorted(logged(straight)) == [4, 5, 6]
    fingerprints = [read_meta(d / "checkpoints" / "6")["fingerprints"] for d in (straight, crashed)]
    assert fingerprints[0] == fingerprints[1]
