"""GRPO's whole step (rollout, scoring, update) against trl's GRPOTrainer on the same CPU, model,
prompts and reward, back to back (docs/performance.md#grpo-against-trl).

    python scripts/benchmark_grpo.py [--steps 6] [--warmup 2] [--hidden 256] [--layers 4]
        [--completions 32] [--generations 8] [--new-tokens 32] [--unshared-prompt] [--json OUT]

The model: benchmark_preference.py's random Qwen 3 (--hidden, --layers) with the Qwen 3 chat
tokenizer of tests/fixtures/chat/qwen3. The prompts: 256 addition questions with a sentence
around them, rendered by the chat template (meshtrain's rows: data.seq_len + 1 = the longest
prompt + --new-tokens, the least that fits; trl pads each batch to its longest). Both sides: --completions completions a step
(--completions / --generations prompts, --generations completions each), sampled at temperature
1 up to --new-tokens tokens, scored by one reward function (the share of the completion's
characters that are digits), one update a rollout (trl's num_iterations=1), the dapo loss
without a KL term (trl's defaults), AdamW at a constant learning rate, fp32 on the CPU, 2
threads. meshtrain trains on rows that hold a prompt once and its completions after it
(data.shared_prompt, its default); --unshared-prompt: a row per completion, as trl feeds them.
Each side runs in a child process of its own, so its peak resident memory is its own.

A step's time is the median over the timed steps after the warm-up of the whole step: trl: the
time between its callback's step ends (generation, scoring and update); meshtrain: its logged
step_time_s, the wall time of a step (the update, and the next step's rollout, which the loop
runs as it reads the next batch: data_wait). The random model seldom picks
an end of sequence, so nearly every completion is --new-tokens long on both sides; the generated
tokens per second count them as generated (meshtrain: completions/mean_length; trl: its
completions/mean_length).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmark_preference import LEARNING_RATE, WORDS, run_in_child, timed_run, write_model

REPO = Path(__file__).resolve().parents[1]
PROMPTS = 256
REWARD = "digit_share"


def digit_share(completions, **kwargs):
    """The reward: the share of a completion's characters that are digits."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def write_prompts(path: Path) -> None:
    """PROMPTS conversational prompts (trl's prompt message lists)."""
    rng = random.Random(0)
    lines = []
    for _ in range(PROMPTS):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        lines.append({"prompt": [{"role": "user", "content": f"{words}: {a}+{b}="}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def longest_prompt(work: Path) -> int:
    """The longest prompt in tokens, as meshtrain encodes it (the chat template's generation
    prompt included): a row holds it and --new-tokens more, data.seq_len + 1 in all."""
    sys.path.insert(0, str(REPO / "src"))
    from meshtrain.rl.prompts import read_prompts

    prompts, _ = read_prompts(
        [str(work / "prompts.jsonl")],
        tokenizer=str(work / "model"),
        chat_template=None,
        prompt_key="prompt",
        on_bad_record="error",
    )
    return max(p.ids.size for p in prompts)


def meshtrain_child(args: argparse.Namespace) -> dict:
    """The GRPO run of `python run_training.py` in this process; its timed steps."""
    work = Path(args.work)
    result = timed_run(
        work,
        args,
        "grpo",
        "data=prompts",
        f"data.paths=[{work / 'prompts.jsonl'}]",
        f"data.seq_len={args.longest_prompt + args.new_tokens - 1}",  # the least that fits
        "objective=grpo",
        f"objective.num_generations={args.generations}",
        f"objective.max_new_tokens={args.new_tokens}",
        f"objective.rewards=[{Path(__file__).resolve()}:{REWARD}]",
        f"training.global_batch_size={args.completions}",
        f"data.shared_prompt={not args.unshared_prompt}",
    )
    timed = [h for h in result.history if h["step"] > args.warmup]
    return {
        "step_s": statistics.median(h["step_time_s"] for h in timed),
        "generate_s": statistics.median(h["rollout/generate_s"] for h in timed),
        "mean_length": statistics.mean(h["completions/mean_length"] for h in timed),
    }


def trl_child(args: argparse.Namespace) -> dict:
    """trl's GRPOTrainer on the same model, prompts and reward; its timed steps."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(args.work)
    ends: list[float] = []
    lengths: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    prompts = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines()]
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32),
        reward_funcs=[digit_share],
        args=GRPOConfig(
            output_dir=str(work / "trl"),
            per_device_train_batch_size=args.completions,
            num_generations=args.generations,
            max_completion_length=args.new_tokens,
            temperature=1.0,
            learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_steps=args.warmup + args.steps,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            dataloader_num_workers=0,
            gradient_checkpointing=False,  # as meshtrain's default (model.remat=none)
        ),
        train_dataset=Dataset.from_list(prompts),
        processing_class=AutoTokenizer.from_pretrained(work / "model"),
        callbacks=[StepTimes()],
    )
    trainer.train()
    times = [b - a for a, b in zip(ends[args.warmup - 1 : -1], ends[args.warmup :], strict=True)]
    return {
        "step_s": statistics.median(times),
        "mean_length": statistics.mean(lengths[args.warmup :]) if lengths else float("nan"),
    }


def run_child(side: str, args: argparse.Namespace) -> dict:
    """One side in a child process: its numbers and its peak resident memory."""
    command = [sys.executable, __file__, "--child", side, "--work", args.work]
    flags = ("steps", "warmup", "hidden", "layers", "completions", "generations", "new_tokens")
    for flag in (*flags, "longest_prompt"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.unshared_prompt:
        command.append("--unshared-prompt")
    return run_in_child(command, Path(args.work) / f"{side}.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--completions", type=int, default=32, help="completions per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="the longest completion")
    parser.add_argument(
        "--unshared-prompt", action="store_true", help="meshtrain: a row per completion"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--longest-prompt", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=["meshtrain", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        measured = meshtrain_child(args) if args.child == "meshtrain" else trl_child(args)
        Path(args.child_out).write_text(json.dumps(measured))
        return
    with tempfile.TemporaryDirectory(prefix="meshtrain-grpo-bench-") as work:
        args.work = work
        write_model(Path(work) / "model", args.hidden, args.layers)
        write_prompts(Path(work) / "prompts.jsonl")
        args.longest_prompt = longest_prompt(Path(work))
        print(
            f"load average {os.getloadavg()[0]:.2f}; prompts of up to {args.longest_prompt} tokens"
        )
        row = {side: run_child(side, args) for side in ("meshtrain", "trl")}
        for side in row.values():
            side["generated_tokens_per_s"] = args.completions * side["mean_length"] / side["step_s"]
        row["ratio"] = row["trl"]["step_s"] / row["meshtrain"]["step_s"]
        m, t = row["meshtrain"], row["trl"]
        print(
            f"meshtrain {m['step_s']:.2f} s/step ({m['generate_s']:.2f} s generating, "
            f"{m['mean_length']:.1f} tokens a completion), peak {m['peak_rss_gib']:.2f} GiB | trl "
            f"{t['step_s']:.2f} s/step ({t['mean_length']:.1f} tokens a completion), peak "
            f"{t['peak_rss_gib']:.2f} GiB | meshtrain {row['ratio']:.2f}x as fast"
        )
        if args.json:
            args.json.write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
