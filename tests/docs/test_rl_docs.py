"""docs/rl.md: its commands run in order as written (SFT → GRPO → generate), and the model
learns what the reward tells it: the sampled answers' rewards/short_answer/mean rises from about
a half at step 1 to at least 0.9 at the last step, and on the 60 held-out prompts of
examples/preference/held_out.jsonl the share of greedy answers that are a number alone goes from
under 10% after SFT to at least 90% after GRPO."""

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
