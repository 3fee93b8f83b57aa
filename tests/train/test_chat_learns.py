"""It learns: a tiny model fine-tuned from a random init with data=chat on a task whose answer is
fully determined by its prompt (reverse a string of 3 to 7 digits) answers held-out prompts
exactly through generate_chat and `python -m meshtrain.generate --chat`. The same run without
masking (data.train_on=all) is trained beside it and its accuracy printed. And the
configs/experiment/*_chat.yaml recipes compose into chat runs of their models."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from helpers.config import compose_config
from helpers.paths import REPO
from helpers.runs import train_tiny

from meshtrain.cli.generate import main
from meshtrain.data.chat.encoder import build_chat_encoder
from meshtrain.errors import ConfigError
from meshtrain.inference.generate import generate_chat
from meshtrain.weights.load import load_model

GEMMA = REPO / "tests" / "fixtures" / "chat" / "gemma3" / "tokenizer.json"
# No 0 or 2: the fixture tokenizer merges "02" and " 2"; each of these digits is one token
# wherever it stands, so an answer is its prompt's tokens reversed.
DIGITS = list("13456789")
TRAIN, HELD_OUT = 4000, 100
STEPS = 120  # the loss on the answers is below 0.01 by step 100 (seeds 0 and 1)
# A tiny model (2 layers, d_model 128) on one device: 16 sequences × 128 tokens, ~4 conversations
# each, per step; about 30 s of training on 2 CPU cores.
RUN = (
    "data=chat",
    f"data.tokenizer={GEMMA}",
    "data.cache_dir=null",
    "data.seq_len=128",
    "data.validation_fraction=0.01",
    "model.vocab_size=512",
    f"training.steps={STEPS}",
    "training.global_batch_size=16",
    "training.learning_rate=3e-3",
    "training.warmup_steps=20",
    "training.log_every=20",
    "training.eval_every=0",
    "checkpoint.every_steps=0",
)


def prompt(word: str) -> str:
    return f"reverse: {word}"


def answer(word: str) -> str:
    return word[::-1]


@pytest.fixture(scope="module")
def reversal(tmp_path_factory):
    """train.jsonl of TRAIN conversations, and HELD_OUT words that none of them asks about."""
    rng = np.random.default_rng(0)
    words: dict[str, None] = {}
    while len(words) < TRAIN + HELD_OUT:
        words["".join(rng.choice(DIGITS, int(rng.integers(3, 8))))] = None
    train, held_out = list(words)[:TRAIN], list(words)[TRAIN:]
    path = tmp_path_factory.mktemp("reversal") / "train.jsonl"
    with path.open("w") as file:
        for word in train:
            messages = [
                {"role": "user", "content": prompt(word)},
                {"role": "assistant", "content": answer(word)},
            ]
            file.write(json.dumps({"messages": messages}) + "\n")
    assert not set(held_out) & set(train)
    return path, held_out


def fine_tune_and_ask(run_dir, data, held_out, *extra) -> dict:
    """Trains RUN (plus `extra`) from a random init, then answers every held-out prompt from the
    saved checkpoint; the share answered exactly, the last logged loss and the seconds each took."""
    start = time.perf_counter()
    result = train_tiny(run_dir, *RUN, f"data.paths=[{data}]", *extra, devices=1)
    trained = time.perf_counter()
    model, encoder = load_model(run_dir), build_chat_encoder(str(GEMMA))
    answers = [
        generate_chat(model, encoder, [{"role": "user", "content": prompt(w)}], 12)
        for w in held_out
    ]
    correct = sum(a == answer(w) for a, w in zip(answers, held_out, strict=True))
    return dict(
        accuracy=correct / len(held_out),
        loss=result.history[-1]["loss"],
        train_s=trained - start,
        generate_s=time.perf_counter() - trained,
        examples=[f"{prompt(w)} -> {a}" for w, a in zip(held_out[:3], answers, strict=False)],
    )


@pytest.mark.slow  # about 75 s: two runs of 120 steps and 200 answers
def test_a_tiny_model_fine_tuned_on_chats_answers_held_out_prompts(reversal, tmp_path, capsys):
    data, held_out = reversal
    masked = fine_tune_and_ask(tmp_path / "assistant", data, held_out)
    unmasked = fine_tune_and_ask(tmp_path / "all", data, held_out, "data.train_on=all")

    # The command, on the masked run's directory: only the answer is printed.
    word = held_out[0]
    argv = [str(tmp_path / "assistant"), "--chat", prompt(word), "--max-new-tokens", "12"]
    capsys.readouterr()
    assert main(argv) == 0
    assert capsys.readouterr().out == answer(word) + "\n"

    with capsys.disabled():
        for name, run in (("train_on=assistant", masked), ("train_on=all", unmasked)):
            print(
                f"\n{name}: {run['accuracy']:.0%} of {len(held_out)} held-out prompts exact "
                f"after {STEPS} steps (last loss {run['loss']:.4f}; trained in "
                f"{run['train_s']:.0f} s, answered in {run['generate_s']:.1f} s); "
                + "; ".join(run["examples"])
            )
    assert masked["accuracy"] >= 0.9, masked
    # Without masking the loss is mostly the prompts' random digits: at 120 steps (and still at
    # 600) it answers none; only the direction is asserted.
    assert 0.0 <= unmasked["accuracy"] <= masked["accuracy"], unmasked


# configs/experiment/<name>.yaml: the model config it selects and the family's fixture tokenizer.
EXPERIMENTS = {
    "gemma3_270m_chat": ("gemma3_270m", "gemma3"),
    "qwen3_0_6b_chat": ("qwen3_0_6b", "qwen3"),
}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_chat_experiments_compose_into_chat_runs_of_their_model(experiment, tmp_path):
    model, family = EXPERIMENTS[experiment]
    tokenizer = REPO / "tests" / "fixtures" / "chat" / family
    cfg = compose_config(
        f"experiment={experiment}",
        f"model.init_from=hf:{tmp_path}",
        f"data.tokenizer={tokenizer}",
        f"data.paths=[{tmp_path / 'chats.jsonl'}]",
    )
    assert cfg.data.source == "chat"
    assert (cfg.model.name, cfg.model.family) == (model, family)
    assert cfg.experiment.name == experiment
    assert cfg.model.init_from == f"hf:{tmp_path}"
    assert cfg.data.tokenizer == str(tokenizer)
    assert cfg.data.seq_len == 1024 and cfg.training.mixed_precision == "bf16"
    assert cfg.training.learning_rate <= 1e-4  # fine-tuning, not the tiny model's 3e-3
    assert 0 < cfg.checkpoint.every_steps < cfg.training.steps
    assert 0 < cfg.training.eval_every < cfg.training.steps


def test_the_init_from_placeholder_stops_a_run_that_does_not_set_it(tmp_path):
    """Left as the recipe has it, model.init_from names no directory: the run stops at start-up
    with one line, rather than training a randomly initialised model."""
    chats = tmp_path / "chats.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chats.write_text(json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ConfigError, match=r"^model.init_from='hf:/path/to/gemma-3-270m-it': "):
        train_tiny(
            tmp_path / "run",
            "experiment=gemma3_270m_chat",
            f"data.tokenizer={GEMMA.parent}",
            f"data.paths=[{chats}]",
            "data.cache_dir=null",
        )


@pytest.fixture(scope="module")
def copying_base(tmp_path_factory):
    """A tiny model fully fine-tuned from a random init to repeat 3 to 7 digits ("copy: 4817"
    → "4817"): a base that knows the digits, on which adapters learn to reverse them."""
    rng = np.random.default_rng(1)
    root = tmp_path_factory.mktemp("copying")
    with (root / "copy.jsonl").open("w") as file:
        for _ in range(TRAIN):
            word = "".join(rng.choice(DIGITS, int(rng.integers(3, 8))))
            messages = [
                {"role": "user", "content": f"copy: {word}"},
                {"role": "assistant", "content": word},
            ]
            file.write(json.dumps({"messages": messages}) + "\n")
    train_tiny(root / "run", *RUN, f"data.paths=[{root / 'copy.jsonl'}]", devices=1)
    return root / "run" / "checkpoints"


# Two LoRA runs of 120 steps and 200 answers on a trained base: 7 minutes on CI's 2 cores, more
# than its slow set can hold beside the rest; a rehearsal with `-m bench`. The slow set keeps the
# adapters' exactness (tests/train/test_lora_training.py, tests/hf/test_lora_live.py).
@pytest.mark.bench
def test_lora_and_qlora_adapters_learn_a_new_task_on_a_frozen_base(
    reversal, copying_base, tmp_path, capsys
):
    """Only rank-16 adapters train, on a frozen base that learned to copy digits: in fp32 and on
    the same base quantised to nf4, both learn to reverse them (the base alone copies)."""
    data, held_out = reversal
    lora = (
        f"checkpoint.load_params={copying_base}",
        "model.lora.rank=16",
        "model.lora.alpha=32",
        "training.learning_rate=1e-2",
    )
    runs = {
        "LoRA": fine_tune_and_ask(tmp_path / "lora", data, held_out, *lora),
        "QLoRA nf4": fine_tune_and_ask(
            tmp_path / "qlora",
            data,
            held_out,
            *lora,
            "model.lora.base_dtype=nf4",
            "model.lora.quant_block=16",
        ),
    }
    with capsys.disabled():
        for name, run in runs.items():
            print(
                f"\n{name}: {run['accuracy']:.0%} of {len(held_out)} held-out prompts exact "
                f"after {STEPS} steps (last loss {run['loss']:.4f}); " + "; ".join(run["examples"])
            )
    assert runs["LoRA"]["accuracy"] >= 0.9, runs["LoRA"]
    assert runs["QLoRA nf4"]["accuracy"] >= 0.9, runs["QLoRA nf4"]
    base, encoder = load_model(copying_base), build_chat_encoder(str(GEMMA))
    asked = [[{"role": "user", "content": prompt(w)}] for w in held_out[:20]]
    base_answers = [generate_chat(base, encoder, messages, 12) for messages in asked]
    assert sum(a == answer(w) for a, w in zip(base_answers, held_out, strict=False)) <= 2
