"""Resuming only what can be continued: every compared key refused or allowed and logged, the
tokenizer by its contents, and mixture shares that count what was drawn across a resume."""

import copy
import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from helpers.runs import train_tiny as _train_tiny
from helpers.short_training import SHORT_TEXT
from helpers.tiny_tokenizers import train_bpe

from meshtrain.checkpoint import read_meta
from meshtrain.config.data import MixtureSource
from meshtrain.config.resume import flatten
from meshtrain.config.schema import Config
from meshtrain.data import BatchIterator, build_dataset
from meshtrain.errors import ConfigError
from meshtrain.train.resume import check_resume, run_meta

# What resume refuses (issue: model architecture, tokenizer, data sources and their weights,
# seq_len, seed, global batch, the loss's masking options); every other key of the schema is
# allowed and logged, or ignored.
REFUSED = {
    *(
        f"model.{k}"
        for k in [
            "vocab_size",
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "mlp_dim",
            "mlp_activation",
            "rope_theta",
            "norm_eps",
            "tie_embeddings",
            "family",
            "attention_pattern",
            "sliding_window",
            "rope_local_theta",
            "rope_scaling",
            "rope_scaling_factor",
            "rope_low_freq_factor",
            "rope_high_freq_factor",
            "rope_original_max_len",
            "qk_norm",
            "post_norms",
            "norm_scale_offset",
            "scale_embeddings",
            "query_pre_attn_scalar",
            "scan_layers",
        ]
    ),
    *(
        f"data.{k}"
        for k in [
            "messages_key",
            "prompt_key",
            "completion_key",
            "chat_template",
            "train_on",
            "overlong",
            "source",
            "paths",
            "path",
            "glob",
            "text_key",
            "document_masking",
            "tokenizer",
            "seq_len",
            "validation_fraction",
            "on_bad_record",
            "chosen_key",
            "rejected_key",
            "shared_prompt",
            "packing",
        ]
    ),
    *(
        f"objective.{k}"
        for k in (
            "name",
            "loss_type",
            "reference",
            "num_generations",
            "num_iterations",
            "steps_per_generation",
        )
    ),
    *(f"data.mixture[{i}].{k}" for i in (0, 1) for k in ("name", "paths", "weight")),
    "training.seed",
    "training.global_batch_size",
    *(f"model.lora.{k}" for k in ("rank", "alpha", "targets", "base_dtype", "quant_block")),
    *(f"model.moe.{k}" for k in ("num_experts", "top_k", "expert_dim", "score", "normalize_top_k")),
}
IGNORED_PREFIXES = ("checkpoint.", "profile.", "plan.", "experiment.", "distributed.", "logging.")
IGNORED = {
    "model.init_std",
    "model.init_from",
    "model.lora.init_from",
    "data.workers",
    "data.cache_dir",
    "data.verify",
    "training.profile",
    "training.profile_communication",
    "training.dry_run",
    "training.compilation_cache_dir",
    "training.xla_gpu_flags",
}
PATH = Path("/run/checkpoints/10")


def _meta(cfg_dict, tokenizer=None):
    return {"config": cfg_dict, "tokenizer": tokenizer}


def _other(value):
    """A value unlike `value`, of a similar kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return f"{value}-other"
    if isinstance(value, list):
        return [*value, "x"]
    if value is None:
        return 7
    raise AssertionError(value)


def _set(config, key, value):
    node = config
    parts = key.replace("]", "").replace("[", ".").split(".")
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[parts[-1]] = value


@pytest.mark.slow
def test_every_key_is_refused_or_allowed_and_logged_or_ignored(caplog):
    cfg = Config()
    cfg.data.mixture = [MixtureSource("a", ["x"], 0.9), MixtureSource("b", ["y"], 0.1)]
    cfg.data.validation_paths = ["v"]  # (from none to some: below)
    base = asdict(cfg)
    saved = _meta(base)
    seen = set()
    for key, value in flatten(base).items():
        if key in ("training.global_batch_size", "data.validation_fraction"):
            continue  # derived: below
        seen.add(key)
        changed = copy.deepcopy(base)
        _set(changed, key, _other(value))
        line = f"{key} {_show(value)} → {_show(_other(value))}"
        caplog.clear()
        if key in REFUSED:
            with pytest.raises(ConfigError) as err:
                check_resume(saved, PATH, _meta(changed), global_batch=8)
            assert f"cannot be continued with this config: {line}; put the old" in str(err.value)
            assert str(err.value).endswith(f"checkpoint.allow_changes=[{_bare(key)}]")
            with caplog.at_level(logging.INFO):  # listed on purpose: continued, logged
                changed["checkpoint"]["allow_changes"] = [_bare(key)]
                check_resume(saved, PATH, _meta(changed), global_batch=8)
            assert f"{line} (checkpoint.allow_changes)" in caplog.text
        elif key in IGNORED or key.startswith(IGNORED_PREFIXES):
            with caplog.at_level(logging.INFO):
                check_resume(saved, PATH, _meta(changed), global_batch=8)
            assert caplog.text == ""
        else:
            with caplog.at_level(logging.INFO):
                check_resume(saved, PATH, _meta(changed), global_batch=8)
            assert f"resuming with changed settings: {line}\n" in caplog.text
    assert REFUSED - {"training.global_batch_size", "data.validation_fraction"} <= seen


def _show(value):
    return value if isinstance(value, str) else json.dumps(value)


def _bare(key):
    return key.replace("[0]", "").replace("[1]", "")


def test_the_global_batch_and_validation_fraction_are_compared_as_they_apply():
    saved = {**_meta(asdict(Config())), "global_batch": 8}
    with pytest.raises(ConfigError, match=r"training\.global_batch_size 8 → 16; put"):
        check_resume(saved, PATH, _meta(asdict(Config())), global_batch=16)
    # Another micro batch or mesh giving the same global batch: allowed, logged.
    other = Config()
    other.training.micro_batch_size = 4
    check_resume(saved, PATH, _meta(asdict(other)), global_batch=8)
    # With data.validation_paths nothing is held out of training: the fraction does not apply.
    held_out = Config()
    held_out.data.validation_paths = ["v"]
    saved_paths = {**_meta(asdict(held_out)), "global_batch": 8}
    held_out.data.validation_fraction = 0.5
    check_resume(saved_paths, PATH, _meta(asdict(held_out)), global_batch=8)
    held_out.data.validation_paths = []
    with pytest.raises(ConfigError, match=r"data\.validation_fraction 0\.0 → 0\.5; put"):
        check_resume(saved_paths, PATH, _meta(asdict(held_out)), global_batch=8)


def test_the_tokenizer_is_compared_by_its_contents(tmp_path):
    cfg = Config()
    cfg.data.tokenizer = str(train_bpe(tmp_path / "a"))
    saved = run_meta(cfg)
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "tokenizer.json").write_bytes(Path(cfg.data.tokenizer).read_bytes())
    cfg.data.tokenizer = str(moved / "tokenizer.json")
    check_resume(saved, PATH, run_meta(cfg), global_batch=8)  # the same file elsewhere
    (moved / "tokenizer.json").write_bytes(train_bpe(tmp_path / "b", 280).read_bytes())
    saved["config"]["data"]["tokenizer"] = cfg.data.tokenizer  # same path, other contents
    with pytest.raises(ConfigError) as err:
        check_resume(saved, PATH, run_meta(cfg), global_batch=8)
    assert (
        f"data.tokenizer {cfg.data.tokenizer} (vocab_size 300) → {cfg.data.tokenizer} "
        "(other contents); put the old value back" in str(err.value)
    )


def train_tiny(run_dir, *overrides):
    return _train_tiny(run_dir, *overrides, devices=1)


# The short text run of helpers.short_training (one compiled step, shared with test_loop.py's
# one-device runs), logged every step.
FAST = ("training.log_every=1", "training.eval_every=0", *SHORT_TEXT)


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Two sources of small text files: every token of `a` is 'a', of `b` is 'b'."""
    root = tmp_path_factory.mktemp("docs")
    for name in "ab":
        (root / name).mkdir()
        for i in range(40):
            (root / name / f"{i}.txt").write_text(name * (20 + i))
    return root


def _mixture(root, weights):
    a, b = weights
    return (
        f"data.mixture=[{{name:a,paths:[{root / 'a'}],weight:{a}}},"
        f"{{name:b,paths:[{root / 'b'}],weight:{b}}}]"
    )


def test_a_resume_with_another_tokenizer_is_refused_before_compiling(tmp_path, documents):
    common = (f"data.paths=[{documents / 'a'}]", "checkpoint.every_steps=2")
    train_tiny(tmp_path, *common, "training.steps=2", *FAST)
    bpe = train_bpe(tmp_path / "bpe")
    with pytest.raises(ConfigError) as err:
        train_tiny(tmp_path, *common, f"data.tokenizer={bpe}", "training.steps=4", *FAST)
    checkpoint = tmp_path / "checkpoints" / "2"
    assert str(err.value) == (
        f"checkpoint {checkpoint} cannot be continued with this config: data.tokenizer byte → "
        f"{bpe}; put the old value back, start a new run directory (hydra.run.dir=...), start "
        "fresh from these weights in a new run directory with "
        f"checkpoint.load_params={checkpoint}, or accept the change on purpose with "
        "checkpoint.allow_changes=[data.tokenizer]"
    )
    assert not (tmp_path / "checkpoints" / "4").exists()


def test_a_data_file_edited_in_place_is_refused_then_accepted_on_purpose(
    tmp_path, documents, capsys
):
    data = tmp_path / "data"
    shutil.copytree(documents / "a", data)
    common = (f"data.paths=[{data}]", "checkpoint.every_steps=2", *FAST)
    train_tiny(tmp_path / "run", *common, "training.steps=2")
    with open(data / "3.txt", "a") as f:
        f.write("a" * 10)
    (data / "new.txt").write_text("a" * 30)
    checkpoint = tmp_path / "run" / "checkpoints" / "2"
    saved = {p: p.read_bytes() for p in sorted(checkpoint.rglob("*")) if p.is_file()}
    with pytest.raises(ConfigError) as err:
        train_tiny(tmp_path / "run", *common, "training.steps=4")
    assert {p: p.read_bytes() for p in sorted(checkpoint.rglob("*")) if p.is_file()} == saved
    assert str(err.value).startswith(
        f'checkpoint {checkpoint} cannot be continued with this config: data.paths ["{data}"] → '
        f'["{data}"] with other files (3.txt: 23 → 33 bytes; new.txt added); put the old value '
        "back,"
    )
    assert str(err.value).endswith("checkpoint.allow_changes=[data.paths]")
    assert not (tmp_path / "run" / "checkpoints" / "4").exists()
    capsys.readouterr()
    result = train_tiny(
        tmp_path / "run", *common, "training.steps=4", "checkpoint.allow_changes=[data.paths]"
    )
    assert [h["step"] for h in result.history] == [3, 4]
    assert (
        f'resuming with changed settings: data.paths ["{data}"] → ["{data}"] with other files '
        "(3.txt: 23 → 33 bytes; new.txt added) (checkpoint.allow_changes), training.steps 2 → 4\n"
        in capsys.readouterr().out
    )
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()


@pytest.mark.slow
def test_changing_scan_layers_names_the_key(tmp_path):
    short = ("data=synthetic", *FAST)
    train_tiny(tmp_path, *short, "model.scan_layers=true", "training.steps=1")
    with pytest.raises(ConfigError, match=r"model\.scan_layers true → false; put the old value"):
        train_tiny(tmp_path, *short, "model.scan_layers=false", "training.steps=2")


def _drawn_a(dataset_cfg_overrides, state, steps, root, weights):
    """How many of the sequences of `steps` (iterator steps) came from source a, read from the
    batches' tokens: with the run's data config and its saved data position."""
    from helpers.config import compose_config

    cfg = compose_config(_mixture(root, weights), *dataset_cfg_overrides)
    train = build_dataset(cfg.data, split="train", vocab_size=cfg.model.vocab_size)
    it = BatchIterator(train, global_batch=8, accum_steps=1, rows=slice(0, 8), seed=0)
    if state is not None:
        it.set_state(state)
    batches = np.concatenate([it.read(k)[0] for k in steps])  # [sequences, seq_len + 1]
    assert np.all((batches == ord("a")).any(axis=1) != (batches == ord("b")).any(axis=1))
    return int(np.sum((batches == ord("a")).any(axis=1))), len(batches)


@pytest.mark.slow
def test_mixture_shares_across_a_resume_with_changed_weights(tmp_path, documents):
    # SHORT_TEXT's constant learning rate: training.steps (10, then 20) is no part of the
    # compiled step, and both runs run the one program of FAST.
    common = ("training.micro_batch_size=8", "checkpoint.every_steps=10", *SHORT_TEXT)
    train_tiny(tmp_path, _mixture(documents, (0.9, 0.1)), *common, "training.steps=10", *FAST)
    with pytest.raises(ConfigError, match=r"data\.mixture\[0\]\.weight 0\.9 → 0\.1; "):
        train_tiny(tmp_path, _mixture(documents, (0.1, 0.9)), *common, "training.steps=20")
    result = train_tiny(
        tmp_path,
        _mixture(documents, (0.1, 0.9)),
        *common,
        "training.steps=20",
        "checkpoint.allow_changes=[data.mixture.weight]",
        *FAST,
    )
    logged = {h["step"]: h["data_share/a"] for h in result.history}
    before, seen = _drawn_a(common, None, range(10), documents, (0.9, 0.1))
    state = read_meta(tmp_path / "checkpoints" / "10")["data"]
    after, more = _drawn_a(common, state, range(10, 20), documents, (0.1, 0.9))
    assert (seen, more) == (80, 80)
    assert logged[20] == (before + after) / 160
    assert 0.35 < logged[20] < 0.65  # about (0.9 + 0.1) / 2, not 0.1
    saved = read_meta(tmp_path / "checkpoints" / "20")["data"]
    assert saved["position"] == 160 and len(saved["mixture"]) == 2
    assert saved["mixture"][1]["start"] == 80
