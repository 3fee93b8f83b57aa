"""docs/preference.md: its commands run in order as written (SFT → DPO → generate → eval), and
the model learns what the pairs tell it: on the 60 held-out prompts of
examples/preference/held_out.jsonl, the share of greedy answers in the preferred format (the sum
first, not "The sum is ...") goes from under 10% after SFT to at least 90% after DPO, and after
SimPO on the same pairs. (How many of those stop right after the sum is printed: the tiny model's
end-of-turn token loses some likelihood with the rejected answers, which end with it too.)"""

from __future__ import annotations

import json

import pytest
from helpers.docs import python_lines, run_walkthrough_line, walkthrough_checkout
from helpers.paths import REPO

from meshtrain.data.chat.encoder import build_chat_encoder
from meshtrain.inference.generate import generate_chat
from meshtrain.weights.load import load_model

DOC = REPO / "docs" / "preference.md"
DEMO = "/tmp/meshtrain-dpo"
GEMMA = REPO / "tests" / "fixtures" / "chat" / "gemma3"


def short_share(run_dir) -> float:
    """The share of held-out prompts whose greedy answer gives the sum first (the preferred
    format); prints it with the share that is the sum alone."""
    model, encoder = load_model(run_dir), build_chat_encoder(str(GEMMA))
    rows = [json.loads(line) for line in (REPO / "examples/preference/held_out.jsonl").open()]
    answers = [
        generate_chat(model, encoder, [{"role": "user", "content": row["prompt"]}], 12).strip()
        for row in rows
    ]
    first = sum(answer[:1].isdigit() for answer in answers) / len(answers)
    alone = sum(answer.isdigit() for answer in answers) / len(answers)
    print(f"{run_dir.name}: the sum first {first:.0%}, the sum alone {alone:.0%}")
    return first


def _run(line: str, cwd) -> str:
    result = run_walkthrough_line(line, cwd, timeout=900)
    return result.stdout + result.stderr


@pytest.mark.slow  # 300 SFT steps, 60 DPO and 60 SimPO steps, 180 generations: about 3 minutes
def test_the_preference_doc_runs_and_the_model_learns_the_preferred_format(tmp_path):
    lines = python_lines(DOC)
    assert [line.split()[1] for line in lines] == ["run_training.py", "run_training.py", "-m", "-m"]
    walkthrough_checkout(tmp_path)
    demo = tmp_path / "demo"
    outputs = []
    for line in lines:
        if "meshtrain.eval" in line and pytest.importorskip("lm_eval") is None:
            continue
        outputs.append(_run(line.replace(DEMO, str(demo)), tmp_path))
    log = (demo / "dpo" / "train.log").read_text()
    assert " step 1/60 loss=0.6931 " in log  # the policy starts as its reference
    last = json.loads((demo / "dpo" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["rewards/accuracies"] == 1.0 and last["rewards/margins"] > 0.5
    assert outputs[2].strip().splitlines()[-1][:1].isdigit()  # meshtrain-generate --chat "12+7="
    before, after = short_share(demo / "sft"), short_share(demo / "dpo")
    assert before < 0.1 and after >= 0.9, (before, after)

    simpo = (
        lines[1]
        .replace(DEMO, str(demo))
        .replace(
            "objective=dpo",
            "objective=dpo objective.loss_type=simpo objective.reference=none objective.beta=2.0",
        )
    )
    _run(simpo.replace(f"{demo}/dpo", f"{demo}/simpo"), tmp_path)
    assert short_share(demo / "simpo") >= 0.9
