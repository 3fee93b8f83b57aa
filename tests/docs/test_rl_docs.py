"""docs/rl.md: its commands run in order as written, and the model learns what the reward tells
it. The format walk-through (SFT → GRPO → generate): the sampled answers'
rewards/short_answer/mean rises from about a half at step 1 to at least 0.9 at the last step, and
on the 60 held-out prompts of examples/preference/held_out.jsonl the share of greedy answers that
are a number alone goes from under 10% after SFT to at least 90% after GRPO. The exact-answer
walk-through (SFT → GRPO, full and LoRA, on examples/rl/arithmetic): the exact-match reward rises
and the 20 held-out additions, never sampled in training, are answered exactly: greedy from at
most half after SFT to at least 85%, sampled at temperature 1 from about 40% to 20 points more."""

from __future__ import annotations

import json

import pytest
from helpers.docs import python_lines, run_walkthrough_line, walkthrough_checkout
from helpers.paths import REPO

from meshtrain.data.chat.encoder import build_chat_encoder
from meshtrain.inference.generate import answer_chats
from meshtrain.weights.load import load_model

DOC = REPO / "docs" / "rl.md"
DEMO = "/tmp/meshtrain-grpo"
ARITHMETIC = "/tmp/meshtrain-arith"
HELD_OUT = REPO / "examples" / "rl" / "arithmetic" / "held_out.jsonl"
SAMPLES = 16  # per held-out prompt, at temperature 1
GEMMA = REPO / "tests" / "fixtures" / "chat" / "gemma3"


def number_alone_share(run_dir) -> float:
    """The share of held-out prompts whose greedy answer is a number alone."""
    model, encoder = load_model(run_dir), build_chat_encoder(str(GEMMA))
    rows = [json.loads(line) for line in (REPO / "examples/preference/held_out.jsonl").open()]
    chats = [[{"role": "user", "content": row["prompt"]}] for row in rows]
    answers = [answer.strip() for answer in answer_chats(model, encoder, chats, 12)]
    share = sum(answer.isdigit() for answer in answers) / len(answers)
    print(f"{run_dir.name}: a number alone {share:.0%}; e.g. {answers[:3]}")
    return share


@pytest.mark.slow  # 300 SFT steps, 40 GRPO steps of 32 completions, 60 answers: about 3 minutes
def test_the_rl_doc_runs_and_the_model_learns_what_the_reward_prefers(tmp_path):
    lines = [line for line in python_lines(DOC) if DEMO in line]  # not the recipes' template
    assert [line.split()[1] for line in lines] == ["run_training.py", "run_training.py", "-m"]
    walkthrough_checkout(tmp_path)
    demo = tmp_path / "demo"
    outputs = [
        run_walkthrough_line(line.replace(DEMO, str(demo)), tmp_path, timeout=900).stdout
        for line in lines
    ]
    records = [json.loads(line) for line in (demo / "grpo" / "metrics.jsonl").open()]
    first, last = records[0], records[-1]
    assert first["step"] == 1 and last["step"] == 40
    assert 0.2 < first["rewards/short_answer/mean"] < 0.8, first
    assert last["rewards/short_answer/mean"] >= 0.9, last
    assert last["completions/mean_length"] < first["completions/mean_length"]
    assert outputs[2].strip().splitlines()[-1].isdigit()  # meshtrain-generate --chat "12+7="
    before, after = number_alone_share(demo / "sft"), number_alone_share(demo / "grpo")
    assert before < 0.1 and after >= 0.9, (before, after)


def exact_shares(run_dir) -> dict[str, float]:
    """The shares of the held-out additions answered exactly and off by one: greedy, and over
    SAMPLES samples of each at temperature 1."""
    model, encoder = load_model(run_dir), build_chat_encoder(str(GEMMA))
    rows = [json.loads(line) for line in HELD_OUT.open()]
    sums = [int(row["answer"]) for row in rows]
    greedy = [a.strip() for a in answer_chats(model, encoder, [r["prompt"] for r in rows], 4)]
    chats = [row["prompt"] for row in rows for _ in range(SAMPLES)]
    sampled = answer_chats(model, encoder, chats, 4, temperature=1.0, seed=1)
    sampled_sums = [total for total in sums for _ in range(SAMPLES)]
    shares = {
        "greedy": _share(greedy, sums, 0),
        "greedy_off_by_one": _share(greedy, sums, 1),
        "sampled": _share(sampled, sampled_sums, 0),
        "sampled_off_by_one": _share(sampled, sampled_sums, 1),
    }
    print(f"{run_dir.name}: {shares}; e.g. {greedy[:4]}")
    return shares


def _share(answers: list[str], sums: list[int], offset: int) -> float:
    return sum(a.strip() == str(s + offset) for a, s in zip(answers, sums, strict=True)) / len(sums)


@pytest.mark.slow  # 300 SFT steps, twice 30 GRPO steps of 64 completions, 340 answers: ~2 min
def test_the_exact_answer_walkthrough_learns_sums_it_never_sampled(tmp_path):
    lines = [line for line in python_lines(DOC) if ARITHMETIC in line]
    assert [line.rsplit("/", 1)[-1] for line in lines] == ["sft", "grpo", "lora"]
    walkthrough_checkout(tmp_path)
    demo = tmp_path / "demo"
    for line in lines:
        run_walkthrough_line(line.replace(ARITHMETIC, str(demo)), tmp_path, timeout=900)
    before = exact_shares(demo / "sft")
    assert before["greedy"] <= 0.5 and 0.25 <= before["sampled"] <= 0.55, before
    for run in ("grpo", "lora"):
        rewards = [
            r["reward"]
            for r in map(json.loads, (demo / run / "metrics.jsonl").open())
            if "reward" in r
        ]
        assert len(rewards) == 7 and 0.25 <= rewards[0] <= 0.55, rewards  # steps 1, 5, ..., 30
        assert min(rewards[-3:]) >= rewards[0] + 0.1, rewards
        after = exact_shares(demo / run)
        assert after["greedy"] >= 0.85, (run, after)
        assert after["sampled"] >= before["sampled"] + 0.2, (run, before, after)
        assert after["sampled_off_by_one"] <= before["sampled_off_by_one"] / 2, (run, after)
