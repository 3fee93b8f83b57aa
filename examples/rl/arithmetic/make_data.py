"""Writes the arithmetic task of docs/rl.md's exact-answer walk-through (stdlib only, seeded):

    python examples/rl/arithmetic/make_data.py

The 100 additions `a+b=` of digits a, b from 0 to 9, split once into 80 for training and 20
held out. `sft.jsonl` answers every one of the 100 five times, shuffled: twice with the sum and
three times with the sum plus one, so that a model fine-tuned on it answers right about 40% of
the time it samples. `prompts.jsonl` (`data=prompts`) holds the 80 training prompts with their
sums in an `answer` column (the exact-match reward's); `held_out.jsonl` the other 20, which GRPO
never samples.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
RIGHT, OFF_BY_ONE = 2, 3  # answers per problem in the SFT data


def chat(question: str, answer: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    }


def prompt(question: str, answer: int) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "answer": str(answer)}


def main() -> None:
    rng = random.Random(0)
    problems = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(problems)
    held_out = set(problems[:20])
    sft = [
        chat(f"{a}+{b}=", str(a + b + wrong))
        for a, b in problems
        for wrong in [0] * RIGHT + [1] * OFF_BY_ONE
    ]
    rng.shuffle(sft)
    files = {
        "sft.jsonl": sft,
        "prompts.jsonl": [prompt(f"{a}+{b}=", a + b) for a, b in sorted(set(problems) - held_out)],
        "held_out.jsonl": [prompt(f"{a}+{b}=", a + b) for a, b in sorted(held_out)],
    }
    for name, records in files.items():
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
