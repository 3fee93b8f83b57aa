"""objective=grpo end to end, in process (meshtrain.rl, train.objectives.policy_gradient): a run
samples, scores and trains, and logs trl's metrics; the same run on a mesh of 8 devices with
accumulation samples the same completions and gives the same losses; a resumed run samples and
trains exactly as the run never stopped; bad settings are one line before anything compiles; a
dry run compiles the sampling program too.
Learning from the rewards: tests/docs/test_rl_docs.py (slow)."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from helpers.config import compose_config
from helpers.paths import REPO
from helpers.process import RUN_TRAINING, run_launcher, subprocess_env
from helpers.runs import train_tiny

from meshtrain.checkpoint.layout import read_meta
from meshtrain.config.validate import check_config
from meshtrain.errors import ConfigError
from meshtrain.inference.generate import generate_ids
from meshtrain.rl.sampling import Sampler, sampling_seed
from meshtrain.train.dry_run import dry_run
from meshtrain.train.setup import prepare
from meshtrain.weights.load import load_model

GEMMA = REPO / "tests" / "fixtures" / "chat" / "gemma3"
PROMPTS = REPO / "examples" / "rl" / "prompts.jsonl"
# A reward a randomly initialised model scores unevenly: the share of its completion's ids below
# 256 (about half of a 512-token vocabulary), so that groups have advantages to train on.
REWARD = "def low_ids(completion_ids, **kwargs):\n    return [sum(i < 256 for i in c) / len(c) for c in completion_ids]\n"


def _grpo_overrides(tmp_path) -> tuple[str, ...]:
    rewards = tmp_path / "low_ids.py"
    rewards.write_text(REWARD)
    return (
        "data=prompts",
        "objective=grpo",
        f"data.paths=[{PROMPTS}]",
        f"data.tokenizer={GEMMA}",
        "model.vocab_size=512",
        "model.num_layers=1",
        "data.seq_len=40",
        "objective.num_generations=4",
        "objective.max_new_tokens=12",
        f"objective.rewards=[{rewards}:low_ids]",
        "training.global_batch_size=16",
        "training.learning_rate=1e-2",
        "training.warmup_steps=1",
        "training.steps=3",
        "training.log_every=1",
        "training.eval_every=0",
        "checkpoint.every_steps=0",
    )


KEYS = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length")


def _alone_and_split_alike(tmp_path, run: tuple[str, ...], keys: tuple[str, ...]):
    """The run `run` on 1 device, and on [[4,2]] fsdp × tp with 2 accumulation steps: the
    records of every step have the same metrics and the same `keys` (1e-5); the first run's
    result."""
    one = train_tiny(tmp_path / "one", *run, devices=1)
    split = train_tiny(
        tmp_path / "split",
        *run,
        "model.mesh_shape=[[4,2],[fsdp,tp]]",
        "training.gradient_accumulation_steps=2",
        devices=8,
    )
    for a, b in zip(one.history, split.history, strict=True):
        assert a.keys() == b.keys()
        for key in keys:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)
    return one


@pytest.mark.slow
def test_a_run_samples_scores_and_trains_the_same_on_any_mesh_and_split(tmp_path):
    one = _alone_and_split_alike(tmp_path, _grpo_overrides(tmp_path), KEYS)
    first = one.history[0]
    assert 0.2 < first["reward"] < 0.8 and first["reward_std"] > 0  # uneven: advantages
    assert first["loss"] != 0 and first["grad_norm"] > 0
    assert first["clip_ratio/region_mean"] == 0  # one update per rollout
    assert first["rewards/low_ids/mean"] == first["reward"]
    assert 1 <= first["completions/min_length"] <= first["completions/max_length"] <= 12
    assert 0 <= first["completions/clipped_ratio"] <= 1
    assert first["rollout/generate_s"] > 0 and first["rollout/tokens_per_sec"] > 0
    assert one.history[1]["rollout/wait_s"] >= 0  # for step 1's update
    records = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").open()]
    assert [r["reward"] for r in records] == [h["reward"] for h in one.history]


@pytest.mark.slow
def test_a_resumed_run_samples_and_trains_as_the_run_never_stopped(tmp_path):
    run = (*_grpo_overrides(tmp_path), "training.lr_schedule=constant", "checkpoint.every_steps=2")
    whole = train_tiny(tmp_path / "whole", *run, "training.steps=4", devices=1)
    train_tiny(tmp_path / "halves", *run, "training.steps=2", devices=1)
    resumed = train_tiny(tmp_path / "halves", *run, "training.steps=4", devices=1)
    assert [h["step"] for h in resumed.history] == [3, 4]
    for a, b in zip(whole.history[2:], resumed.history, strict=True):
        assert [a[k] for k in KEYS] == [b[k] for k in KEYS]  # bit for bit


@pytest.mark.slow
def test_a_generation_feeds_several_steps_the_same_on_any_mesh_and_split(tmp_path):
    """μ = 2 updates on each generation of 2 steps' prompts: one generation every 4 steps,
    sampled and scored (the old log-probabilities) by the policy of its first step."""
    run = (
        *_grpo_overrides(tmp_path),
        "objective.num_iterations=2",
        "objective.steps_per_generation=2",
        "training.steps=5",
    )
    one = _alone_and_split_alike(tmp_path, run, (*KEYS, "clip_ratio/region_mean"))
    # A generation at steps 1 and 5 only: each step logs the rollout metrics of its generation.
    generate_s = [h["rollout/generate_s"] for h in one.history]
    assert generate_s[:4] == [generate_s[0]] * 4 and generate_s[4] != generate_s[0]
    assert one.history[0]["rollout/old_log_probs_s"] > 0
    # Step 1 trains with the policy that sampled: every ratio is 1 (to rounding), nothing clips.
    assert one.history[0]["clip_ratio/region_mean"] == 0
    # Steps 3 and 4 train on step 1's and 2's completions again, with a policy moved by lr 1e-2.
    assert max(h["clip_ratio/region_mean"] for h in one.history[2:4]) > 0


@pytest.mark.slow  # two processes start, sample and train; one process here: about a minute
def test_two_processes_sample_and_train_as_one(tmp_path):
    """2 processes × 4 faked devices over gloo, fsdp across both ([[8,1]]), 2 updates a
    generation: each process samples every completion with the same key and scores them, and the
    run logs the rewards and losses of one process on 8 devices; its step-3 checkpoint, inside a
    generation, holds that generation's rows."""
    run = (
        *_grpo_overrides(tmp_path),
        "model.mesh_shape=[[8,1],[fsdp,tp]]",
        "objective.num_iterations=2",
        "training.steps=4",
        "checkpoint.every_steps=3",
    )
    two = tmp_path / "two"
    launched = run_launcher(
        "--nprocs", "2", "--devices-per-process", "4", str(RUN_TRAINING), *run,
        f"hydra.run.dir={two}", env=subprocess_env(1), timeout=600,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    one = train_tiny(tmp_path / "one", *run, devices=8).history
    records = [json.loads(line) for line in (two / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for a, b in zip(one, records, strict=True):
        for key in (*KEYS, "clip_ratio/region_mean"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)
    assert "generation" in read_meta(two / "checkpoints" / "3")["data_arrays"]


def test_the_first_update_of_a_generation_is_the_on_policy_update(tmp_path):
    """With μ = 2, step 1's loss and gradient are those of μ = 1 (the old log-probabilities are
    the policy's own); the completions, sampled with the same key, are the same."""
    run = (*_grpo_overrides(tmp_path), "training.steps=1")
    once = train_tiny(tmp_path / "once", *run, devices=1).history[0]
    twice = train_tiny(tmp_path / "twice", *run, "objective.num_iterations=2", devices=1)
    twice = twice.history[0]
    assert twice["reward"] == once["reward"]
    assert twice["completions/mean_length"] == once["completions/mean_length"]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(twice[key], once[key], rtol=1e-5)
    assert twice["clip_ratio/region_mean"] == 0


@pytest.mark.slow
def test_a_run_resumed_inside_a_generation_trains_on_its_completions(tmp_path):
    """A checkpoint at step 3 of a 4-step generation holds that generation's rows: the resumed
    run trains steps 4 to 6 (a new generation at 5) exactly as the run never stopped."""
    run = (
        *_grpo_overrides(tmp_path),
        "objective.num_iterations=2",
        "objective.steps_per_generation=2",
        "training.lr_schedule=constant",
        "checkpoint.every_steps=3",
    )
    whole = train_tiny(tmp_path / "whole", *run, "training.steps=6", devices=1)
    train_tiny(tmp_path / "halves", *run, "training.steps=3", devices=1)
    saved = read_meta(tmp_path / "halves" / "checkpoints" / "3")
    assert saved["data"]["step"] == 3 and "reward" in saved["data"]["generation_metrics"]
    # 2 steps of 4 rows, each a prompt and its 4 completions (data.shared_prompt): 41 + 3 × 13
    # tokens, 4 advantages, the token share and 79 old log-probabilities.
    assert saved["data_arrays"] == {"generation": {"shape": [2, 1, 4, 164], "dtype": "int32"}}
    resumed = train_tiny(tmp_path / "halves", *run, "training.steps=6", devices=1)
    assert [h["step"] for h in resumed.history] == [4, 5, 6]
    keys = (*KEYS, "clip_ratio/region_mean")
    for a, b in zip(whole.history[3:], resumed.history, strict=True):
        assert [a[k] for k in keys] == [b[k] for k in keys]  # bit for bit
    assert resumed.history[0]["reward"] != resumed.history[1]["reward"]  # step 5 sampled


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("objective=grpo", "data=chat"),
            "objective=grpo samples its completions from prompts: set data=prompts "
            "(data.source='chat')",
        ),
        (
            ("data=prompts",),
            "data=prompts holds prompts to sample completions from, which objective=lm does "
            "not do: set objective=grpo",
        ),
        (
            ("objective=grpo", "data=prompts"),
            "objective.rewards is empty: name at least one reward function, e.g. "
            "'objective.rewards=[examples/rl/rewards.py:correct_sum]'",
        ),
        (
            (
                "objective=grpo",
                "data=prompts",
                "objective.rewards=[m:f]",
                "objective.temperature=0",
            ),
            "objective.temperature=0.0 must be > 0: greedy completions of one prompt are all "
            "the same",
        ),
        (
            ("objective=grpo", "data=prompts", "objective.rewards=[m:f]", "objective.beta=0.04"),
            "objective.beta=0.04 weighs the KL to a reference: set objective.reference=initial "
            "(or objective.beta=0)",
        ),
        (
            (
                "objective=grpo",
                "data=prompts",
                "objective.rewards=[m:f]",
                "objective.reference=precomputed",
            ),
            "objective.reference=precomputed scores fixed pairs before training; grpo's "
            "completions are sampled as it trains: set objective.reference=initial",
        ),
        (
            (
                "objective=grpo",
                "data=prompts",
                "objective.rewards=[m:f]",
                "objective.loss_type=bnpo",
            ),
            "objective.loss_type='bnpo' is not a grpo loss; use one of: grpo, dr_grpo, dapo",
        ),
        (
            (
                "objective=grpo",
                "data=prompts",
                "objective.rewards=[m:f]",
                "objective.num_generations=1",
            ),
            "objective.num_generations=1 must be >= 2: advantages compare the completions of "
            "one prompt",
        ),
        (
            (
                "objective=grpo",
                "data=prompts",
                "objective.rewards=[m:f,n:g]",
                "objective.reward_weights=[1.0]",
            ),
            "objective.reward_weights has 1 weights for 2 reward functions: give one per "
            "function (or none: all 1)",
        ),
        (
            (
                "objective=grpo",
                "data=prompts",
                "objective.rewards=[m:f]",
                "objective.num_iterations=0",
            ),
            "objective.num_iterations=0 must be >= 1 (updates per generation)",
        ),
        (
            (
                "objective=grpo",
                "data=prompts",
                "objective.rewards=[m:f]",
                "objective.importance_sampling_level=sentence",
            ),
            "objective.importance_sampling_level='sentence' is not supported; use one of: "
            "token, sequence",
        ),
    ],
)
def test_bad_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        check_config(compose_config(*overrides, "data.paths=[x.jsonl]", f"data.tokenizer={GEMMA}"))
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("training.global_batch_size=18",),
            "training.global_batch_size=18 completions are not whole groups of "
            "objective.num_generations=4; use a multiple of 4",
        ),
        (
            ("data.seq_len=16",),
            "data.seq_len=16: a row holds a prompt and its completion, and the longest prompt "
            "has 17 tokens; with objective.max_new_tokens=12 set data.seq_len=28 or more (or "
            "lower objective.max_new_tokens)",
        ),
        (
            (f"objective.rewards=[{REPO}/examples/rl/rewards.py:nothing]",),
            f"objective.rewards[0]='{REPO}/examples/rl/rewards.py:nothing': {REPO}/examples/rl/"
            "rewards.py has no function 'nothing'; give 'module:function', "
            "'path/to/file.py:function' or a built-in (exact_match, format_match)",
        ),
        (
            ("objective.rewards=[exact_match]", "objective.answer_column=solution"),
            "objective.answer_column='solution': 400 of 400 records of data.paths have no such "
            "column (a record's columns: answer); set objective.answer_column to the column "
            "exact_match compares with",
        ),
    ],
)
def test_shapes_and_functions_that_cannot_work_are_one_line_before_the_compile(
    overrides, message, tmp_path
):
    cfg = compose_config(*_grpo_overrides(tmp_path), *overrides)
    with pytest.raises(ConfigError) as error:
        prepare(cfg, jax.devices()[:1])
    assert str(error.value).startswith(message)


def test_held_out_prompts_are_sampled_and_scored_at_each_evaluation(tmp_path):
    """data.validation_paths' prompts: G completions each, with the same keys at every
    evaluation, scored by the run's rewards and logged as val_<metric>; what is logged at the
    last step is what those prompts' completions from the final state score. Greedy, the
    sampler picks what meshtrain-generate picks from the saved run."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(PROMPTS.read_text().splitlines(keepends=True)[:3]))
    result = train_tiny(
        tmp_path / "run",
        *_grpo_overrides(tmp_path),
        f"data.validation_paths=[{held_out}]",
        "training.eval_every=2",
        devices=1,
    )
    evaluated = [h["step"] for h in result.history if "val_reward" in h]
    assert evaluated == [2, 3]  # every 2 steps and the last
    last, setup = result.history[-1], result.setup
    validation = setup.rollouts.validation
    assert len(validation) == 3

    def sampler(objective):
        rollouts = setup.rollouts
        return Sampler(
            setup.model,
            rollouts.rewards,
            rollouts.tokenizer,
            objective,
            width=rollouts.width,
            mesh=setup.mesh,
        )

    padded = [*validation, validation[0]]  # 4 completions each, 12: one batch of 16
    with jax.set_mesh(setup.mesh):
        completions = sampler(setup.cfg.objective).sample(
            result.state, padded, sampling_seed(0, 0, 0)
        )
    completions = completions[:12]
    low = [sum(i < 256 for i in c) / len(c) for c in completions]
    np.testing.assert_allclose(last["val_reward"], np.mean(low), rtol=1e-6)
    np.testing.assert_allclose(last["val_rewards/low_ids/mean"], np.mean(low), rtol=1e-6)
    lengths = [c.size for c in completions]
    assert last["val_completions/mean_length"] == np.mean(lengths)
    assert last["val_completions/max_length"] == max(lengths) <= 12
    # Greedy, the rollouts' sampler picks what meshtrain-generate picks from the saved run.
    greedy = sampler(dataclasses.replace(setup.cfg.objective, temperature=0.0))
    with jax.set_mesh(setup.mesh):
        rollouts = greedy.sample(result.state, validation, 0)
    saved = load_model(tmp_path / "run")
    for index, prompt in enumerate(validation):
        alone = generate_ids(saved, prompt.ids, 12, 0.0, stop_ids=prompt.stop_ids)
        for rollout in rollouts[4 * index : 4 * index + 4]:  # its group: the same, greedy
            np.testing.assert_array_equal(rollout, alone)


@pytest.mark.parametrize(
    ("experiment", "model", "family"),
    [("gemma3_270m_grpo", "gemma3_270m", "gemma3"), ("qwen3_0_6b_grpo", "qwen3_0_6b", "qwen3")],
)
def test_the_grpo_experiments_compose_into_grpo_runs_of_their_model(
    experiment, model, family, tmp_path
):
    tokenizer = REPO / "tests" / "fixtures" / "chat" / family
    common = (
        f"experiment={experiment}",
        f"model.init_from=hf:{tmp_path}",
        f"data.tokenizer={tokenizer}",
        f"data.paths=[{PROMPTS}]",
    )
    cfg = compose_config(*common, "objective.rewards=[examples/rl/rewards.py:correct_sum]")
    check_config(cfg)
    assert (cfg.model.name, cfg.model.family, cfg.experiment.name) == (model, family, experiment)
    assert (cfg.data.source, cfg.objective.name, cfg.objective.loss_type) == (
        "prompts",
        "grpo",
        "dapo",
    )
    objective = cfg.objective
    assert cfg.training.global_batch_size % objective.num_generations == 0
    assert cfg.data.seq_len > objective.max_new_tokens and cfg.training.mixed_precision == "bf16"
    assert cfg.training.learning_rate <= 1e-5 and objective.beta == 0
    with pytest.raises(ConfigError, match=r"^objective.rewards is empty: "):
        check_config(compose_config(*common))


@pytest.mark.slow
def test_a_dry_run_compiles_the_rollouts_sampling_program_too(tmp_path, capsys):
    """training.dry_run=true compiles the sampling program beside the step (with plan.target, for
    GPUs: docs/rl.md), for the step's completions and the longest prompt bucket a row leaves."""

    overrides = (
        *_grpo_overrides(tmp_path),
        "model.mesh_shape=[[4,2],[fsdp,tp]]",
        "training.dry_run=true",
    )
    cfg = compose_config(*overrides)
    dry_run(cfg, tmp_path / "run", devices=jax.devices())
    report = json.loads((tmp_path / "run" / "compile.json").read_text())
    assert report["rollout"]["fusions"] > 0 and report["rollout"]["seconds"] > 0
    assert "compiled the rollouts' sampling program in " in capsys.readouterr().out
    # A generation that feeds 2 updates is also scored by the policy that sampled it: one more
    # program, a forward pass over the step's rows (its matmuls).
    dry_run(
        compose_config(*overrides, "objective.num_iterations=2"),
        tmp_path / "twice",
        devices=jax.devices(),
    )
    twice = json.loads((tmp_path / "twice" / "compile.json").read_text())["rollout"]
    assert twice["matmul_flops"] > report["rollout"]["matmul_flops"]
    assert twice["fusions"] > report["rollout"]["fusions"]
